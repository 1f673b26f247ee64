"""Preallocated KV cache with tree-capable append and commit.

Glossary
- slot: a request's row in the cache (``0 .. max_slots-1``).
- committed length: entries ``[0, length)`` of a slot hold the K/V of tokens that are part
  of the request's accepted text; they sit at contiguous positions.
- scratch entries: a forward writes the K/V of its N new tokens at ``length .. length+N-1``
  whatever their logical positions or mask (a chain, a tree, padding). They are not committed
  until :meth:`KVCache.commit` moves a chosen subset to ``length .. length+k-1``.

All layers live in one tensor ``[layers, 2 (k/v), max_slots, kv_heads, capacity, head_dim]`` so a
commit moves every layer's entries with one gather and one scatter; ``k[layer]`` / ``v[layer]``
are ``[max_slots, kv_heads, capacity, head_dim]`` views, so attention reads a slot range as a view. ``capacity = max_context + scratch`` so a round never writes past
the end. Lengths live on the device (``lengths``); the engine keeps its own host copy.
"""

from __future__ import annotations

import dataclasses

import torch

from flashtree.kernels.gpu import tree as tree_kernels


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    max_slots: int  # max running requests
    max_context: int  # committed tokens per request
    scratch: int  # max new tokens per forward beyond the committed context (tree size, chunk)
    kv_heads: int
    head_dim: int

    @property
    def capacity(self) -> int:
        return self.max_context + self.scratch

    def bytes(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.max_slots * self.kv_heads * self.capacity * self.head_dim * elem


class KVCache:
    def __init__(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str):
        self.spec = spec
        self.storage = torch.zeros(spec.num_layers, 2, spec.max_slots, spec.kv_heads, spec.capacity,
                                   spec.head_dim, dtype=dtype, device=device)
        self.k = [self.storage[i, 0] for i in range(spec.num_layers)]
        self.v = [self.storage[i, 1] for i in range(spec.num_layers)]
        self.lengths = torch.zeros(spec.max_slots, dtype=torch.long, device=device)  # [max_slots]
        self.commit_kernel = False  # commit moves entries with tree_kernels.commit_entries (the engine's triton_tree)

    @staticmethod
    def write_index(slots: torch.Tensor, starts: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) ``[B, N]`` each: where a forward's N new entries per row go."""
        slot_idx = slots[:, None].expand(-1, n_new)  # [B, N]
        pos_idx = starts[:, None] + torch.arange(n_new, device=starts.device)  # [B, N]
        return slot_idx, pos_idx

    def write_at(self, layer: int, index: tuple[torch.Tensor, torch.Tensor],
                 k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the new entries at ``index`` (from :meth:`write_index`).

        k_new, v_new: ``[B, N, kv_heads, head_dim]``.
        """
        slot_idx, pos_idx = index
        self.k[layer][slot_idx, :, pos_idx] = k_new
        self.v[layer][slot_idx, :, pos_idx] = v_new

    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write N new entries per row at ``starts[b] + i``; k_new, v_new: ``[B, kv_heads, N, head_dim]``."""
        index = self.write_index(slots, starts, k_new.shape[2])
        self.write_at(layer, index, k_new.transpose(1, 2), v_new.transpose(1, 2))

    def view(self, layer: int, slots: torch.Tensor, kv_len: int,
             slot_range: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, kv_heads, kv_len, head_dim]`` for the rows' slots.

        ``slot_range=(first, count)`` when the slots are ``first .. first+count-1`` in order:
        then this is a view and copies nothing.
        """
        if slot_range is not None:
            first, count = slot_range
            return (self.k[layer][first:first + count, :, :kv_len],
                    self.v[layer][first:first + count, :, :kv_len])
        return self.k[layer][slots, :, :kv_len], self.v[layer][slots, :, :kv_len]

    def commit(self, slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor,
               keep_counts: torch.Tensor) -> None:
        """Keep a subset of each row's scratch entries and make them committed.

        slots, starts: ``[B]`` (starts = committed length before this forward, where the
        scratch entries begin); keep: ``[B, P]`` indices into the row's new entries, in the
        order they must take, padded with anything past ``keep_counts[b]``; keep_counts: ``[B]``.
        Entry ``keep[b, j]`` moves to ``starts[b] + j``; everything else is dead. Lengths are set,
        not incremented, so running the same commit twice (CUDA-graph warm-up) is harmless.
        """
        if self.commit_kernel:  # the lengths too
            tree_kernels.commit_entries(self.storage, slots, starts, keep, keep_counts, self.lengths)
            return
        n_keep = keep.shape[1]
        src = starts[:, None] + keep.clamp(min=0)  # [B, P]
        dst = starts[:, None] + torch.arange(n_keep, device=keep.device)  # [B, P]
        slot_idx = slots[:, None].expand(-1, n_keep)  # [B, P]
        moved = self.storage[:, :, slot_idx, :, src]  # [B, P, layers, 2, kv_heads, head_dim] (before writing)
        self.storage[:, :, slot_idx, :, dst] = moved
        self.lengths[slots] = starts + keep_counts

    def commit_prefix(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first ``counts[b]`` scratch entries where they are (chains: the accepted
        path is a prefix of the new entries, so nothing moves). Lengths are set, not incremented."""
        self.lengths[slots] = starts + counts

    def advance(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first ``counts[b]`` scratch entries in place (chains, prefill)."""
        self.lengths[slots] += counts

    def free(self, slots: torch.Tensor) -> None:
        self.lengths[slots] = 0
