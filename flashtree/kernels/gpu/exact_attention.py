"""Attention whose result for a query depends only on the keys it sees (the exact mode's attention, issue #29).

Glossary:
- logical keys: what a query at depth ``t`` of a row with ``c`` committed entries attends to, in order: the
  committed entries ``0 .. c-1``, then its ancestors among the new tokens by depth (its own entry last). A plain
  decoding step at the same position sees the same keys with the same values.
- key order: for each new token, the indices (among the row's new tokens) of its ancestors, shallowest first
  (:func:`ancestor_order`). For a causal chain (a prompt chunk, a DFlash block) the k-th ancestor is token k,
  so no table is needed.

The fast kernel (:mod:`attention`) reduces a row's keys in the order they sit in the cache and splits them by
how many programs the launch has, so a tree node rounds differently from the plain step it stands for. Here a
program handles the query heads of one (row, kv head, new token); keys go in blocks of :data:`BLOCK_N` logical
keys (float32: ``FLOAT32_KEY_LOOP``), split s holds logical keys ``SPLIT_KEYS * s ..`` whatever the context, and
the splits merge in split order with one formula, whether each split ran in a program of its own (few query
groups: the device needs the parallelism) or one program ran them all (many). So a query's arithmetic is a
function of its logical keys only: bit-identical whatever the batch, the number of new tokens per row, or the
tree's shape.
"""

from __future__ import annotations

import torch

from flashtree.kernels.gpu import interpreting
from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2
from flashtree.kernels.gpu.attention import _kernels, _multiprocessors, check_head_layout

# The key loop, 16-bit dtypes: logical keys per block (a divisor of SPLIT_KEYS; it sets the online softmax's steps,
# so the bits) and pipeline stages (no arithmetic depends on them). benchmarks/gpu_exact_attention.py (H100, Qwen3-8B
# heads, 1k context, session 31): 128 keys / 2 stages against 64 / 3 took batch 32's DFlash-16 from 219 to 127 us a
# layer and DDTree-16 from 510 to 422. Float32 keeps 64 / 3 (FLOAT32_KEY_LOOP).
BLOCK_N = 128
STAGES = 2
FLOAT32_KEY_LOOP = (64, 3)
SPLIT_KEYS = 512  # logical keys per split: split s of every query holds its logical keys 512 s .. 512 s + 511
# new tokens per program by the forward's new tokens per row, for causal chains and for trees: (largest N it
# serves, tokens). A program reads its row's committed keys once for all its tokens, and attends a tree's own
# keys once per token (so trees gain from wider tiles only when they are large). Which program computes a token
# changes none of its arithmetic as long as every tile has at most MAX_TILE_ROWS query rows: on Hopper (H100,
# 2026-12-06) 64-row tiles (wgmma) gave other bits than 16- and 32-row tiles (mma), as the FP8 product's did.
# benchmarks/gpu_exact_attention.py (H100, Qwen3-8B heads, 1k context, us per layer at batch 1 / 32 with 4
# against 8 tokens): DFlash-16 80 / 277 against 76 / 185; DDTree-16 75 / 504 against 122 / 537; DDTree-64
# 107 / 1,421 against 88 / 1,221. tests/gpu/test_exact_mode.py checks that 4 and 8 agree (16-bit dtypes).
TOKENS_PER_TILE = {"chain": ((4, 4), (1 << 62, 8)), "tree": ((32, 4), (1 << 62, 8))}
MAX_TILE_ROWS = 32


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ancestor_order(new_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order ``[B, N, N]`` int32, depth ``[B, N]`` int32) from ``new_mask [B, N, N]`` (token i sees new token j).

    ``order[b, i, k]`` is the index of the k-th new token token i sees (its ancestor at depth k, when ancestors
    come before their descendants, as in every tree the engine builds), for k <= ``depth[b, i]`` (= how many it
    sees, minus one); entries past the depth are 0."""
    b, n, _ = new_mask.shape
    depth = new_mask.sum(-1, dtype=torch.int32) - 1  # [B, N]
    rank = new_mask.cumsum(-1) - 1  # [B, N, N]: rank of token j among those token i sees
    slot = torch.where(new_mask, rank, n)  # unseen tokens go to a column dropped below
    index = torch.arange(n, dtype=torch.int32, device=new_mask.device).expand(b, n, n)
    order = torch.zeros(b, n, n + 1, dtype=torch.int32, device=new_mask.device)
    order.scatter_(2, slot, index)
    return order[..., :n].contiguous(), depth


def tokens_per_tile(new_tokens: int, group_pad: int, causal: bool = True, ieee: bool = False) -> int:
    """New tokens per program for a forward of ``new_tokens`` per row (``causal``: a chain, else a tree): the
    table's entry, within the 16 .. MAX_TILE_ROWS query rows of a tile (``group_pad`` rows per token; a
    group wider than that gets one token a tile, the same at every width). 16 rows at every width for float32
    (``ieee``: its products are not tensor-core ones, and 16- and 32-row tiles rounded apart on the H100) and
    under the interpreter."""
    if ieee or interpreting():
        return max(1, 16 // group_pad)
    table = TOKENS_PER_TILE["chain" if causal else "tree"]
    tokens = next(t for limit, t in table if new_tokens <= limit)
    return max(1, min(tokens, MAX_TILE_ROWS // group_pad), 16 // group_pad)


def exact_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    slots: torch.Tensor, lengths: torch.Tensor,
                    key_order: tuple[torch.Tensor, torch.Tensor] | None = None,
                    parallel: bool | None = None, tokens: int | None = None) -> torch.Tensor:
    """Attention of N new tokens per row over the paged KV cache, each query over its logical keys; returns
    ``[B, H, N, D]``.

    q: ``[B, H, N, D]``; k_cache/v_cache: one layer's ``[pages, KVH, page_size, D]`` views; block_table
    ``[slots, pages_per_slot]``; row b's slot ``slots[b]`` holds ``lengths[b]`` committed entries followed by
    the N new tokens' entries. ``key_order``: :func:`ancestor_order` of the rows' new-token mask, or None for
    causal chains (new token t sees new tokens 0 .. t). ``parallel``: splits in programs of their own, merged
    by a second kernel (what few query groups need to fill the device), or all in one program (None: chosen by
    the launch's size; the same values either way). ``tokens``: new tokens per program (a power of two;
    None: :func:`tokens_per_tile`), which changes no value either.
    """
    b, heads, n, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    check_head_layout("exact_attention", head_dim, heads, kv_heads)
    group = heads // kv_heads
    group_pad = _next_power_of_2(group)
    tokens = tokens or tokens_per_tile(n, group_pad, causal=key_order is None, ieee=q.dtype == torch.float32)
    block_m = group_pad * tokens
    if tokens & (tokens - 1) or block_m < 16:
        raise ValueError(f"exact_attention: tokens per tile must be a power of two giving >= 16 query rows, "
                         f"got {tokens} for {group_pad} heads per kv head")
    tiles = _ceil_div(n, tokens)  # token tiles per row
    if parallel is None:
        parallel = b * kv_heads * tiles < 2 * _multiprocessors(q.device)
    max_splits = _ceil_div(block_table.shape[1] * page_size, SPLIT_KEYS) if parallel else 1
    q = q.contiguous()
    out = torch.empty_like(q)
    part = torch.empty(b, heads, n, max_splits, head_dim, dtype=torch.float32, device=q.device) if parallel else out
    lse = torch.empty(b, heads, n, max_splits, dtype=torch.float32, device=q.device) if parallel else out
    order, depth = key_order if key_order is not None else (lengths, lengths)  # (not read when causal)
    block_n, stages = FLOAT32_KEY_LOOP if q.dtype == torch.float32 else (BLOCK_N, STAGES)
    kernels = _kernels()
    kernels._exact_attention_kernel[(tiles, b * kv_heads, max_splits)](
        q, k_cache, v_cache, block_table.contiguous(), slots.contiguous(), lengths.contiguous(), order, depth,
        out, part, lse, n, heads, kv_heads, head_dim ** -0.5 * 1.4426950408889634, block_table.shape[1], page_size,
        SPLIT_KEYS, max_splits, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PARALLEL=parallel,
        CAUSAL=key_order is None, IEEE=q.dtype == torch.float32, INTERPRET=interpreting(), num_stages=stages,
        **_launch_options())
    if parallel:
        kernels._merge_splits_kernel[(b * heads * n,)](part, lse, out, max_splits, HEAD_DIM=head_dim,
                                                       **_launch_options())
    return out


def _launch_options() -> dict:
    """The two paths must round alike: no multiply-add contracted into an fma in one kernel and not in the
    other (the interpreter rounds every op anyway)."""
    return {} if interpreting() else {"enable_fp_fusion": False}
