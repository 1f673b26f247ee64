"""Masked attention over the KV cache, shared by the target and the drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds an execution plan per new shape on the host (about 1 ms per call on the
# H200 at Qwen3-8B shape); our key lengths change every step, so eager decoding spent most of
# its time there. The memory-efficient kernel takes arbitrary boolean masks without that cost.
_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[B, H, N, D]``, keys/values ``[B, KVH, K, D]``, mask ``[B, 1, N, K]`` bool -> ``[B, H, N, D]``."""
    gqa = q.shape[1] != keys.shape[1]
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    with sdpa_kernel(_BACKENDS):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
