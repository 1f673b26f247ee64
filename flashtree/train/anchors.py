"""Anchors: where the training blocks of a sequence start, and what each block must predict.

Glossary
- B: sequences in the batch; N: padded sequence length; A: anchors per sequence; b: block size.
- anchor t: a position whose token plays the bonus token; the block is
  ``[token t, MASK x (b-1)]`` at positions ``t .. t+b-1``. Its queries read the context
  features of tokens ``0 .. t-1`` (committed context), exactly as at inference where the bonus
  token has not yet run through the target.
- labels: slot k (1..b-1) must predict ``token[t + k]``.
- label mask: slot k counts when token ``t+1 .. t+k`` are all assistant tokens of the sequence
  (a block never trains across the end of an assistant turn).

Anchors are drawn uniformly without replacement among positions t with assistant tokens at t
and t+1; a row with fewer than A such positions gets padding anchors (``valid`` False).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AnchorBlocks(NamedTuple):
    positions: torch.Tensor  # [B, A] int64 anchor positions, ascending; padding anchors at 0
    valid: torch.Tensor  # [B, A] bool
    block_ids: torch.Tensor  # [B, A, b] int64: anchor token then mask_token_id
    block_positions: torch.Tensor  # [B, A, b] int64: anchor + slot
    labels: torch.Tensor  # [B, A, b-1] int64: token at anchor + k, k = 1..b-1
    label_mask: torch.Tensor  # [B, A, b-1] bool


def anchor_candidates(assistant_mask: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` bool: positions t with assistant tokens at t and t+1."""
    nxt = torch.zeros_like(assistant_mask)
    nxt[:, :-1] = assistant_mask[:, 1:]
    return assistant_mask & nxt


def sample_anchors(assistant_mask: torch.Tensor, count: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` anchor positions per row, sorted, and their validity: both ``[B, A]``.

    assistant_mask: ``[B, N]`` bool. A = min(count, N)."""
    candidates = anchor_candidates(assistant_mask)  # [B, N]
    count = min(count, assistant_mask.shape[1])
    scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)  # [B, N] in [0, 1)
    scores = torch.where(candidates, scores, -1.0)
    picked = torch.topk(scores, count, dim=1)  # [B, A]
    valid = picked.values >= 0  # [B, A]
    positions = torch.where(valid, picked.indices, 0)  # [B, A]
    order = torch.argsort(positions + (~valid).long() * assistant_mask.shape[1], dim=1)  # valid first, ascending
    return positions.gather(1, order), valid.gather(1, order)


def build_blocks(input_ids: torch.Tensor, assistant_mask: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor, block_size: int, mask_token_id: int) -> AnchorBlocks:
    """Blocks, labels and label masks for given anchors.

    input_ids, assistant_mask: ``[B, N]``; positions, valid: ``[B, A]``."""
    n = input_ids.shape[1]
    slots = torch.arange(block_size, device=input_ids.device)  # [b]
    block_positions = positions[:, :, None] + slots  # [B, A, b]
    block_ids = torch.full_like(block_positions, mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, positions)  # [B, A]
    target_pos = block_positions[:, :, 1:]  # [B, A, b-1]
    in_range = target_pos < n
    flat = target_pos.clamp(max=n - 1).flatten(1)  # [B, A*(b-1)]
    labels = input_ids.gather(1, flat).view_as(target_pos)  # [B, A, b-1]
    is_assistant = assistant_mask.gather(1, flat).view_as(target_pos) & in_range  # [B, A, b-1]
    label_mask = torch.cumprod(is_assistant.long(), dim=2).bool() & valid[:, :, None]
    return AnchorBlocks(positions, valid, block_ids, block_positions, labels, label_mask)


def make_blocks(input_ids: torch.Tensor, assistant_mask: torch.Tensor, anchors_per_seq: int, block_size: int,
                mask_token_id: int, generator: torch.Generator | None = None) -> AnchorBlocks:
    """Sample anchors and build their blocks (``[B, N]`` inputs, see :class:`AnchorBlocks`)."""
    positions, valid = sample_anchors(assistant_mask, anchors_per_seq, generator)
    return build_blocks(input_ids, assistant_mask, positions, valid, block_size, mask_token_id)
