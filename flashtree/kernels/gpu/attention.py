"""Tree attention on CUDA: each row's N new tokens over its KV-cache entries, read through the block table."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashtree.kernels.gpu import interpreting
from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_attention

    return triton_attention


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, which holds the (row, kv head) pairs


class AttentionTile(NamedTuple):
    """One launch configuration of the tree attention: query rows ((token, head) pairs of one kv head) per
    program, keys per loop step, warps, pipeline stages, key splits (None: :func:`_key_splits`)."""

    block_m: int
    block_n: int = 64
    warps: int = 4
    stages: int = 3
    splits: int | None = None


def default_tile(query_rows: int, dtype: torch.dtype) -> AttentionTile:
    """The tile for ``query_rows`` (new tokens x query heads per kv head) of every (row, kv head). In 16-bit
    types: 16 or 32 query rows a program (wider tiles hold more registers and leave fewer programs), 128 keys
    a step, two pipeline stages: the best launch benchmarks/gpu_tree_attention.py found on an H100 (Qwen3-8B
    heads, 1k context, batch 1 to 32, every forward from a plain step to DDTree-64). float32 takes 64-key
    steps (128 x 128 float32 K and V tiles in two stages overflow shared memory)."""
    if dtype == torch.float32:
        return AttentionTile(block_m=min(64, max(16, _next_power_of_2(query_rows))))
    return AttentionTile(block_m=16 if query_rows <= 16 else 32, block_n=128, warps=4, stages=2)


def _key_splits(programs: int, capacity: int, device: torch.device) -> int:
    """Key splits per (row, kv head, query tile): enough programs for about two waves on the
    device, at most one split per 128 cache entries, a power of two up to 16."""
    want = max(1, min(2 * _multiprocessors(device) // max(programs, 1), capacity // 128, 16))
    return 1 << (want.bit_length() - 1)


def check_head_layout(kernel: str, head_dim: int, heads: int, kv_heads: int) -> None:
    """The attention kernels take a power-of-two head_dim >= 16 and query heads in groups per kv head."""
    if head_dim < 16 or head_dim & (head_dim - 1) or heads % kv_heads:
        raise ValueError(f"{kernel} needs a power-of-two head_dim >= 16 and heads divisible by kv heads, "
                         f"got head_dim={head_dim}, heads={heads}, kv_heads={kv_heads}")


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   slots: torch.Tensor, lengths: torch.Tensor, new_mask: torch.Tensor, window: int | None = None,
                   splits: int | None = None, tile: AttentionTile | None = None,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of N new tokens per row over the paged KV cache; returns ``[B, H, N, D]``.

    q: ``[B, H, N, D]``; k_cache/v_cache: one layer's ``[pages, KVH, page_size, D]`` views;
    block_table: ``[slots, pages_per_slot]`` page ids. Row b's positions (in slot ``slots[b]``, each
    on the page its block-table entry names) hold the committed entries ``0 .. lengths[b]-1``
    followed by the N new tokens' entries. Query i of row b sees every committed entry (only the
    last ``window`` ones with a sliding window) and new token t where ``new_mask[b, i, t]``.
    ``splits`` overrides the number of key splits (tests); ``tile`` the launch configuration (a sweep,
    benchmarks/gpu_tree_attention.py; default :func:`default_tile`). ``counts [B]``: only row b's first
    ``counts[b]`` new tokens are real (a packed forward, models/packing.py; each sees only real new tokens):
    query tiles past them read no key, and their outputs are zeros or the attention of padding (finite).
    """
    b, heads, n, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    check_head_layout("tree_attention", head_dim, heads, kv_heads)
    group = heads // kv_heads
    if b * kv_heads > MAX_GRID_Y:
        raise ValueError(f"tree_attention takes at most {MAX_GRID_Y} (row, kv head) pairs per launch, got "
                         f"{b} rows x {kv_heads} kv heads")
    tile = tile or default_tile(n * group, q.dtype)
    m_tiles = -(-n * group // tile.block_m)
    splits = splits or tile.splits or _key_splits(b * kv_heads * m_tiles, block_table.shape[1] * page_size, q.device)
    q = q.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(q)
    part = out if splits == 1 else torch.empty(b, heads, n, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = out if splits == 1 else torch.empty(b, heads, n, splits, dtype=torch.float32, device=q.device)
    _kernels()._tree_attention_kernel[(m_tiles, b * kv_heads, splits)](
        q, k_cache, v_cache, block_table, slots.contiguous(), lengths.contiguous(),
        new_mask.contiguous().view(torch.uint8), lengths if counts is None else counts.contiguous(), part, lse, n,
        heads, kv_heads, window or 0,
        head_dim ** -0.5 * 1.4426950408889634, block_table.shape[1], page_size,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, SPLITS=splits,
        IEEE=q.dtype == torch.float32, INTERPRET=interpreting(), HAS_COUNTS=counts is not None, num_warps=tile.warps,
        num_stages=tile.stages)
    if splits > 1:
        _kernels()._combine_splits_kernel[(b * heads * n,)](part, lse, out, SPLITS=splits, HEAD_DIM=head_dim)
    return out
