"""ForwardBatch: what one target forward runs over, for a batch of rows.

Every row (one request) brings N new tokens (padded to the batch's N) with their own
absolute positions and their own visibility pattern among the new tokens (``new_mask``):
a causal chain for prefill / decode / DFlash verification, an ancestor mask for a DDTree,
nothing but itself for padding. Every new token also sees all of its row's committed context.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.models.packing import TokenPacking


class ForwardBatch(NamedTuple):
    input_ids: torch.Tensor  # [B, N] int64
    positions: torch.Tensor  # [B, N] int64, absolute positions for RoPE
    slots: torch.Tensor  # [B] int64, KV-cache slot of each row
    cache_lengths: torch.Tensor  # [B] int64, committed entries per row (new ones go after)
    new_mask: torch.Tensor  # [B, N, N] bool, new_mask[b, i, j]: new token i sees new token j
    kv_len: int  # keys attended per row; >= max(cache_lengths) + N
    one_off_shape: bool = False  # a prefill's shape, which seldom recurs: attention builds no plan for it
    prefill: bool = False  # prompt chunks (not a decode round or a drafter block)
    # every row's real new tokens form a causal chain (token i sees tokens 0 .. i; padding after them): prompt
    # chunks, DFlash verification; the exact attention then reads them in one pass without an ancestor table
    chain: bool = False
    # the exact attention's ancestor order of new_mask (kernels/gpu/exact_attention.py), set by the target's
    # forward in exact mode; None otherwise (and for causal prompt chunks)
    key_order: tuple[torch.Tensor, torch.Tensor] | None = None
    # the ragged layout (models/packing.py): the products run over the packed real tokens, attention over
    # [B, N]; the forward's hidden states and logits are then [1, T, ...]. None: every [B, N] entry runs
    packing: TokenPacking | None = None

    @property
    def num_new(self) -> int:
        return self.input_ids.shape[1]


def causal_mask(new_counts: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width, width]`` causal mask where row b has ``new_counts[b]`` real tokens; padded
    tokens see only themselves (so no attention row is empty)."""
    idx = torch.arange(width, device=new_counts.device)
    causal = idx[None, :, None] >= idx[None, None, :]  # [1, W, W]
    real = idx[None, :] < new_counts[:, None]  # [B, W]
    eye = torch.eye(width, dtype=torch.bool, device=new_counts.device)[None]
    return torch.where(real[:, :, None], causal & real[:, None, :], eye)


def attention_mask(batch: ForwardBatch) -> torch.Tensor:
    """``[B, 1, N, kv_len]`` bool: committed context, plus the new tokens allowed by ``new_mask``."""
    n_new = batch.num_new
    key = torch.arange(batch.kv_len, device=batch.cache_lengths.device)  # [K]
    rel = key[None, :] - batch.cache_lengths[:, None]  # [B, K] offset into the new tokens
    committed = rel < 0  # [B, K]
    is_new = (rel >= 0) & (rel < n_new)  # [B, K]
    gather_idx = rel.clamp(0, n_new - 1)[:, None, :].expand(-1, n_new, -1)  # [B, N, K]
    new_visible = batch.new_mask.gather(2, gather_idx)  # [B, N, K]
    return (committed[:, None, :] | (is_new[:, None, :] & new_visible))[:, None]

