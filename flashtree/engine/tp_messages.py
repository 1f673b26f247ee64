"""What rank 0 sends the tensor-parallel workers, laid out once for both sides.

A command is a small tuple through the worker's pipe (the op, the static facts, the block-table
writes since the last command); its tensors follow through the process group as broadcasts (one
int64 buffer, and the forward's visibility mask as bytes), device to device.

| op | pipe | broadcast |
| --- | --- | --- |
| ``cache`` | the KV cache spec, dtype, page pool and block-table shape | nothing |
| ``forward`` | :class:`ForwardMeta` | ints (ids, positions, slots, lengths, logits index), mask |
| ``commit`` | (rows, kept entries per row, commit kernel on) | ints (slots, starts, keep, counts) |
| ``stop`` | nothing | nothing |

Every command but ``stop`` carries the block-table writes ``(rows, cols, pages)`` rank 0 made since
the previous one; a worker applies them before the command's work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.models.batch import ForwardBatch

PageWrites = list[tuple[list[int], list[int], list[int]]]  # (rows, cols, page ids) per PageTable write


class ForwardMeta(NamedTuple):
    """A forward's static facts (the worker allocates its receive buffers from them)."""

    rows: int  # B
    new: int  # N new tokens per row
    logits: int  # M positions scored per row (-1: all, no logits index)
    kv_len: int
    one_off_shape: bool
    prefill: bool


def pack_forward(batch: ForwardBatch, logits_index: torch.Tensor | None
                 ) -> tuple[ForwardMeta, torch.Tensor, torch.Tensor]:
    """(meta, ints [2BN + 2B (+ BM)] int64, mask [B, N, N] uint8) of a forward's inputs."""
    if batch.packing is not None:
        raise ValueError("a tensor-parallel forward takes the padded layout only (ForwardBatch.packing must be None)")
    parts = [batch.input_ids.reshape(-1), batch.positions.reshape(-1), batch.slots, batch.cache_lengths]
    if logits_index is not None:
        parts.append(logits_index.reshape(-1))
    ints = torch.cat([p.long() for p in parts])
    mask = batch.new_mask.to(torch.uint8).contiguous()
    b, n = batch.input_ids.shape
    meta = ForwardMeta(b, n, -1 if logits_index is None else logits_index.shape[1], int(batch.kv_len),
                       batch.one_off_shape, batch.prefill)
    return meta, ints, mask


def forward_buffers(meta: ForwardMeta, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty receive buffers shaped as :func:`pack_forward`'s tensors for ``meta``."""
    b, n, m = meta.rows, meta.new, max(meta.logits, 0)
    ints = torch.empty(2 * b * n + 2 * b + b * m, dtype=torch.long, device=device)
    return ints, torch.empty(b, n, n, dtype=torch.uint8, device=device)


def unpack_forward(meta: ForwardMeta, ints: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[ForwardBatch, torch.Tensor | None]:
    """The forward's (batch, logits_index) back from :func:`pack_forward`'s tensors."""
    b, n = meta.rows, meta.new
    input_ids, positions, slots, lengths, rest = ints.split([b * n, b * n, b, b, ints.numel() - 2 * b * n - 2 * b])
    batch = ForwardBatch(input_ids.view(b, n), positions.view(b, n), slots, lengths, mask.bool(), meta.kv_len,
                         meta.one_off_shape, meta.prefill)
    return batch, None if meta.logits < 0 else rest.view(b, meta.logits)


def pack_commit(slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor, keep_counts: torch.Tensor
                ) -> tuple[tuple[int, int], torch.Tensor]:
    """((rows, kept entries per row), ints) of a KV commit's arguments (``KVCache.commit``)."""
    ints = torch.cat([slots.long(), starts.long(), keep.reshape(-1).long(), keep_counts.long()])
    return tuple(keep.shape), ints


def unpack_commit(shape: tuple[int, int], ints: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, p = shape
    slots, starts, keep, counts = ints.split([b, b, b * p, b])
    return slots, starts, keep.view(b, p), counts


def commit_buffer(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    b, p = shape
    return torch.empty(3 * b + b * p, dtype=torch.long, device=device)
