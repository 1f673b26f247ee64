"""The fused-ops interface."""

from __future__ import annotations

import torch


def qkv_write_operands(qkv: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       write_index: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Checked, contiguous operands of a qkv_norm_rope_write (either backend): qkv, the empty q
    ``[B, H, N, D]`` output, and the write slots and entries ``[B, N]``."""
    b, n, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    if head_dim % 2 or head_dim * (heads + 2 * kv_heads) != width:
        raise ValueError(f"qkv of width {width} does not hold {heads} + 2 x {kv_heads} heads of an even size")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must be views with the same strides and a contiguous last dim")
    slots, entries = (t.contiguous() for t in write_index)
    return qkv.contiguous(), qkv.new_empty(b, heads, n, head_dim), slots, entries
