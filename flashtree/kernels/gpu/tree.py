"""DDTree's tree work on CUDA: kept lists, node selection, accept walk and KV commit, one program per row."""

from __future__ import annotations

import functools

import torch

from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_tree

    return triton_tree


# warps per program of the tree kernels (one program per row)
TREE_WARPS = 4
# the kept-list kernel's, by threshold search: its sorts run faster on 8 warps (budget 256, narrow:
# 0.081 against 0.097 ms on the H200), its bisection does not
EXPAND_WARPS = {"sort": 8, "bisect": 4, "narrow": 8}
# prefilter lists (padded to a power of two) up to this length find each depth's threshold by a
# sort, longer ones by a search (_kth_largest): on the H200 at batch 1 sorting is faster at budgets
# 16 and 64, the search at 256 and 1024 (0.45 against 0.54 ms for build + walk at 256)
SORT_LIST_MAX = 512
# longer lists narrow the bisection and then sort what is left ("narrow") when the sort is at most
# this long (twice the padded budget: budgets 65-256), else they bisect to the end ("bisect")
NARROW_MAX = 512
THRESHOLD_SEARCHES = ("sort", "bisect", "narrow")


def threshold_search(pairs: int, max_budget: int) -> str:
    """The kept-list kernel's default threshold search for a prefilter list of ``pairs`` entries."""
    if _next_power_of_2(pairs) <= SORT_LIST_MAX:
        return "sort"
    return "narrow" if 2 * _next_power_of_2(max_budget) <= NARROW_MAX else "bisect"


def expand_levels(top_logp: torch.Tensor, top_tokens: torch.Tensor, max_budget: int, pair_row: torch.Tensor,
                  pair_rank: torch.Tensor, num_warps: int | None = None, search: str | None = None,
                  stage_clocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``speculative/tree/build.py _expand_levels`` for float32 log-probs, exactly: per depth the ``max_budget``
    best prefixes, ties to the lower (parent place, rank). top_logp / top_tokens: ``[R, L, K]``
    (K best per depth, descending); pair_row / pair_rank: ``[M]`` the prefilter pairs of
    ``tree._prefilter_pairs``. Returns weights, parent places and tokens, ``[R, L, B]`` each.
    ``num_warps``: per program (default :data:`EXPAND_WARPS` of the search; benchmarks compare others).
    ``search``: how each depth's threshold is found, one of :data:`THRESHOLD_SEARCHES` (default
    :func:`threshold_search`; ``triton_tree._expand_levels_kernel`` describes them); all give
    the same lists.
    ``stage_clocks``: an int64 ``[R, 8]`` tensor that receives SM cycles per stage of the kernel
    (CUDA only; ``triton_tree._expand_levels_kernel`` names the stages)."""
    if top_logp.dtype != torch.float32:
        raise ValueError(f"expand_levels needs float32 log-probs, got {top_logp.dtype}")
    search = threshold_search(pair_row.numel(), max_budget) if search is None else search
    if search not in THRESHOLD_SEARCHES:
        raise ValueError(f"search must be one of {THRESHOLD_SEARCHES}, got {search!r}")
    rows, depth, k = top_logp.shape
    block = _next_power_of_2(max_budget)
    block_m = _next_power_of_2(pair_row.numel())
    narrow = 2 * block if search == "narrow" else 0
    weights = top_logp.new_empty(rows, depth, max_budget)
    parents = torch.empty(rows, depth, max_budget, dtype=torch.long, device=top_logp.device)
    tokens = torch.empty_like(parents)
    index_scratch = torch.empty(rows, 2, block, dtype=torch.int32, device=top_logp.device)  # slot marks, row starts
    weight_scratch = top_logp.new_empty(rows, 2 * block + narrow)  # kept weights, the same sorted, gathered list
    _kernels()._expand_levels_kernel[(rows,)](
        top_logp.contiguous(), top_tokens.contiguous(), pair_row.to(torch.int32), pair_rank.to(torch.int32),
        weights, parents, tokens, index_scratch, weight_scratch, _clocks_or_dummy(stage_clocks, tokens), k,
        max_budget, pair_row.numel(), DEPTH=depth, BLOCK_B=block, BLOCK_M=block_m, LOG_K=k.bit_length(),
        SEARCH=THRESHOLD_SEARCHES.index(search), NARROW=narrow, CLOCKS=stage_clocks is not None,
        num_warps=num_warps or EXPAND_WARPS[search])
    return weights, parents, tokens


def _clocks_or_dummy(stage_clocks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The stage-clock output, or any int64 tensor for the unused pointer when clocks are off."""
    if stage_clocks is None:
        return like
    if stage_clocks.dtype != torch.int64 or stage_clocks.shape != (like.shape[0], 8):
        raise ValueError(f"stage_clocks must be int64 [{like.shape[0]}, 8], got {stage_clocks.dtype} "
                         f"{tuple(stage_clocks.shape)}")
    return stage_clocks


def select_nodes(weights: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, budgets: torch.Tensor,
                 max_budget: int, num_warps: int | None = None,
                 stage_clocks: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``speculative/tree/build.py _select_nodes`` and ``_assemble`` in one kernel per row, exactly: from the
    kept lists (weights / parent places / tokens ``[R, L, B]``, as :func:`expand_levels` returns
    them) and budgets ``[R]``, the tree's tokens, parents, depths, valid ``[R, B+1]``, ancestor mask
    ``[R, B+1, B+1]`` and log weights ``[R, B+1]`` (DraftTree's field order). ``stage_clocks``: as
    in :func:`expand_levels`."""
    rows, depth, budget = weights.shape
    size = budget + 1
    block_f = _next_power_of_2(depth * budget)
    block_n = _next_power_of_2(size)
    block_l = _next_power_of_2(depth + 1)
    device = weights.device
    long = dict(dtype=torch.long, device=device)
    out_tokens, out_parents, out_depths = (torch.empty(rows, size, **long) for _ in range(3))
    valid = torch.empty(rows, size, dtype=torch.uint8, device=device)
    log_weights = weights.new_empty(rows, size)
    mask = torch.zeros(rows, size, size, dtype=torch.uint8, device=device)  # (a memset: faster than in the kernel)
    flat_scratch, node_scratch = (torch.empty(rows, block_f, dtype=torch.int32, device=device) for _ in range(2))
    anc_scratch = torch.empty(rows, block_n, block_l, dtype=torch.int32, device=device)
    _kernels()._select_nodes_kernel[(rows,)](
        weights.contiguous(), parents.contiguous(), tokens.contiguous(), budgets.contiguous(), out_tokens, out_parents,
        out_depths, valid, log_weights, mask, flat_scratch, node_scratch, anc_scratch,
        _clocks_or_dummy(stage_clocks, out_tokens), budget, DEPTH=depth, BLOCK_F=block_f,
        BLOCK_B=_next_power_of_2(budget), BLOCK_N=block_n, BLOCK_L=block_l,
        CLOCKS=stage_clocks is not None, num_warps=num_warps or TREE_WARPS)
    return out_tokens, out_parents, out_depths, valid.view(torch.bool), mask.view(torch.bool), log_weights


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, choice: torch.Tensor,
                max_depth: int) -> tuple[torch.Tensor, ...]:
    """``speculative/verify.py accept_walk`` in one kernel per row: tree tokens / parents / valid and the
    target's choices ``[R, N]`` -> path and committed tokens ``[R, max_depth + 1]``, accept
    lengths and next bonus tokens ``[R]``."""
    rows, size = tokens.shape
    path = torch.empty(rows, max_depth + 1, dtype=torch.long, device=tokens.device)
    committed = torch.empty_like(path)
    lengths = torch.empty(rows, dtype=torch.long, device=tokens.device)
    bonus = torch.empty_like(lengths)
    _kernels()._accept_walk_kernel[(rows,)](
        tokens.contiguous(), parents.contiguous(), valid.contiguous().view(torch.uint8), choice.long().contiguous(),
        path, committed, lengths, bonus, size, STEPS=max_depth, BLOCK_N=_next_power_of_2(size), num_warps=TREE_WARPS)
    return path, lengths, bonus, committed


def commit_entries(storage: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                   keep: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor) -> None:
    """``kv.cache.KVCache.commit`` in one kernel (one program per row and layer x k/v): storage
    ``[layers, 2, pages, kv_heads, page_size, head_dim]`` read through ``block_table [slots,
    pages_per_slot]``; position ``starts[b] + keep[b, j]`` of slot ``slots[b]`` moves to
    ``starts[b] + j`` for j < P (keep: ``[B, P]``), and the slot's committed length becomes
    ``lengths[slots[b]] = starts[b] + counts[b]`` (lengths: ``[slots]`` int64)."""
    layers, _, num_pages, heads, page_size, head_dim = storage.shape
    rows, n_keep = keep.shape
    if not storage.is_contiguous():
        raise ValueError("commit_entries needs a contiguous KV storage")
    if lengths.dtype != torch.long or not lengths.is_contiguous():
        raise ValueError(f"commit_entries needs contiguous int64 lengths, got {lengths.dtype}")
    block_table = block_table.contiguous()
    _kernels()._commit_kernel[(rows, layers * 2)](
        storage, block_table, slots.contiguous(), starts.contiguous(), keep.long().contiguous(),
        counts.long().contiguous(), lengths, n_keep, block_table.shape[1], heads * page_size * head_dim,
        num_pages * heads * page_size * head_dim, page_size, heads, head_dim, BLOCK_P=_next_power_of_2(n_keep),
        BLOCK_H=_next_power_of_2(heads), BLOCK_D=_next_power_of_2(head_dim), num_warps=4)
