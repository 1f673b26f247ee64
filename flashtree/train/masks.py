"""The block-sparse attention mask of drafter training.

Key axis: ``[context features of tokens 0..N-1, block slots of anchor 0, of anchor 1, ...]``
(N + A*b keys). Query axis: the block slots, ``A*b`` of them, anchor-major.
A query of anchor a sees
- context key j when ``j < positions[a]`` (the committed context before its anchor; with a
  sliding ``window``, only the last ``window`` of those), and
- every slot of its own block (non-causal inside the block), nothing of other blocks.
Every query sees at least its own block, so no attention row is empty.

Two forms of the same rule: a dense boolean mask (CPU, tests, small runs) and a flex-attention
``BlockMask`` (CUDA; it skips the all-masked tiles, which is most of them).
"""

from __future__ import annotations

import torch


def dense_block_mask(positions: torch.Tensor, context_len: int, block_size: int,
                     window: int | None = None) -> torch.Tensor:
    """``[B, 1, A*b, N + A*b]`` bool (True = attend). positions: ``[B, A]`` anchor positions."""
    batch, anchors = positions.shape
    device = positions.device
    ctx_key = torch.arange(context_len, device=device)  # [N]
    sees_ctx = ctx_key[None, None, :] < positions[:, :, None]  # [B, A, N]
    if window is not None:
        sees_ctx &= ctx_key[None, None, :] >= positions[:, :, None] - window
    sees_ctx = sees_ctx.repeat_interleave(block_size, dim=1)  # [B, A*b, N]
    block_of = torch.arange(anchors * block_size, device=device) // block_size  # [A*b]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, A*b, A*b]
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def block_mask_mod(positions: torch.Tensor, context_len: int, block_size: int, window: int | None = None):
    """The rule as a flex-attention ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = positions[b, block]
        sees_ctx = (kv_idx < context_len) & (kv_idx < anchor)
        if window is not None:
            sees_ctx = sees_ctx & (kv_idx >= anchor - window)
        sees_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return sees_ctx | sees_block

    return mask_mod


def flex_block_mask(positions: torch.Tensor, context_len: int, block_size: int, window: int | None = None):
    """The same rule as a flex-attention ``BlockMask`` for ``[B, H, A*b, N + A*b]`` scores."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, anchors = positions.shape
    n_query = anchors * block_size
    mask_mod = block_mask_mod(positions, context_len, block_size, window)
    return create_block_mask(mask_mod, batch, None, n_query, context_len + n_query, device=positions.device)
