"""Inputs of attention checks: a batched prefill chunk over partly filled caches."""

import torch

from flashtree.models.batch import ForwardBatch, attention_mask, causal_mask


def prefill_like(rows=3, heads=8, kv_heads=2, new=5, cached=(0, 4, 2), dim=16, seed=0):
    """q, keys, values and the bool mask of a batched prefill chunk over partly filled caches."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = max(cached) + new
    counts = torch.tensor([new, new - 2, 1][:rows])
    batch = ForwardBatch(torch.zeros(rows, new, dtype=torch.long), torch.zeros(rows, new, dtype=torch.long),
                         torch.arange(rows), torch.tensor(cached[:rows]), causal_mask(counts, new), kv_len=kv_len)
    q = torch.randn(rows, heads, new, dim, generator=gen)
    keys = torch.randn(rows, kv_heads, kv_len, dim, generator=gen)
    values = torch.randn(rows, kv_heads, kv_len, dim, generator=gen)
    return q, keys, values, attention_mask(batch)
