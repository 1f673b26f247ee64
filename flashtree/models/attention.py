"""Masked attention over the KV cache, shared by the target and the drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Backend note (H200, Qwen3-8B shape): PyTorch's default choice (cuDNN attention for these masked
# shapes) is the fast one under CUDA graphs; the memory-efficient kernel makes a graphed decode step
# 1.6x slower at batch 1 and 8.7x at batch 32. But cuDNN builds an execution plan for every new
# shape, 40-65 ms each on the H200. Rounds have few shapes (padded rows, 256-key buckets) and
# are captured once; a prefill's (rows, width, keys) seldom recurs, so it would pay that on most
# prefills. Shapes marked one-off therefore go to kernels that build no plan.
PLANLESS_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On CUDA, the bool mask as an additive bias (0 / -inf) in ``dtype``, made once per forward:
    SDPA would otherwise convert the bool mask in every layer (two extra kernels each). Other
    devices keep the bool mask."""
    if not mask.is_cuda:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     one_off_shape: bool = False) -> torch.Tensor:
    """q ``[B, H, N, D]``, keys/values ``[B, KVH, K, D]``, mask ``[B, 1, N, K]`` (bool, or the
    additive bias of :func:`attention_bias`) -> ``[B, H, N, D]``. ``one_off_shape`` (a prefill's):
    on CUDA, attend with a kernel that builds no per-shape plan (see the backend note)."""
    if one_off_shape and q.is_cuda:
        return planless_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


def fold_query_groups(q: torch.Tensor, mask: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention as attention with one query head per KV head: the G = H / KVH query
    heads that share KV head k (heads k*G ... k*G + G - 1) become G*N queries of head k.
    q ``[B, H, N, D]`` -> ``[B, KVH, G*N, D]``; mask ``[B, 1, N, K]`` -> ``[B, 1, G*N, K]``. The
    memory-efficient kernel takes no GQA, and folding copies the queries and the mask rather than
    G times the keys and values."""
    b, h, n, d = q.shape
    groups = h // kv_heads
    return q.reshape(b, kv_heads, groups * n, d), mask.repeat(1, 1, groups, 1)


def planless_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       backends: list[SDPBackend] = PLANLESS_BACKENDS) -> torch.Tensor:
    """:func:`masked_attention`'s result through the memory-efficient kernel (math as the fallback
    for shapes it refuses), never cuDNN: same shapes in and out. ``backends``: the kernels allowed."""
    b, h, n, d = q.shape
    folded_q, folded_mask = fold_query_groups(q, mask, keys.shape[1])
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(folded_q, keys, values, attn_mask=folded_mask)  # [B, KVH, G*N, D]
    return out.reshape(b, h, n, d)
