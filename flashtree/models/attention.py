"""Masked attention over the KV cache, shared by the target and the drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Backend note (H200, Qwen3-8B shape, benchmarks/README.md): PyTorch's default choice (cuDNN
# attention for these masked shapes) is the fast one under CUDA graphs. Forcing the
# memory-efficient kernel made a graphed decode step 1.6x slower at batch 1 and 8.7x at batch 32.


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On CUDA, the bool mask as an additive bias (0 / -inf) in ``dtype``, made once per forward:
    SDPA would otherwise convert the bool mask in every layer (two extra kernels each). Other
    devices keep the bool mask."""
    if not mask.is_cuda:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[B, H, N, D]``, keys/values ``[B, KVH, K, D]``, mask ``[B, 1, N, K]`` (bool, or the
    additive bias of :func:`attention_bias`) -> ``[B, H, N, D]``."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
