"""DDTree: the best draft tree for a budget, built on the device without host syncs.

Glossary
- R: rows (running requests) in the batch.
- L: draft depth, ``block_size - 1``; depth d = 1..L is the d-th drafted position.
- V: vocabulary size.
- B: ``max_budget``, the static number of drafted nodes per row (the root excluded).
- K: ``min(B, V)``, the tokens per depth that can appear in a tree.
- prefix: a token sequence ``(u_1..u_d)``; its weight is ``sum_i log q_i(u_i)``
  (the log of the product of the drafter marginals).
- rank: a token's place in its depth's descending order (0 = most likely).
- node axis: ``[root, node_1 .. node_B]`` (B+1 entries); index 0 is the root (bonus token).
- valid: a node that is part of the tree; padded / non-existent nodes are invalid.
- kept list: the best B prefixes of one depth, stored in lexicographic rank order.

Algorithm: depth by depth, expand the kept prefixes of depth d-1 by the
top-K tokens of depth d, keep the best B of depth d, then take each row's best ``budget`` over
all depths. Order among equal weights: shallower first, then lexicographically smaller ranks.
Nodes are laid out by (depth, weight descending, ranks), so parents come before children.
Small trees of CPU tensors take the same steps in numpy after the top-k (``host.py``: the
same tree, fewer small ops).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from flashtree.kernels import gpu as gpu_kernels
from flashtree.kernels.gpu import topk as topk_kernels
from flashtree.kernels.gpu import tree as tree_kernels
from flashtree.speculative.tree import host as tree_host
from flashtree.speculative.tree.draft_tree import NO_PARENT, PAD_TOKEN, ROOT, ROOT_TOKEN, DraftTree


class _Level(NamedTuple):
    """The kept list of one depth: B prefixes in lexicographic rank order."""

    log_weights: torch.Tensor  # [R, B] float; -inf for prefixes that do not exist
    parent_pos: torch.Tensor  # [R, B] int64; place of the parent in the previous kept list
    tokens: torch.Tensor  # [R, B] int64


# a round's per-row budget rule: (each row's best path log-weights [R, B] descending, the rows' caps
# [R] int64) -> budgets [R] int64 with 0 <= budgets <= caps; device work, no host sync
Allot = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_tree(
    draft_logits: torch.Tensor, budgets: torch.Tensor | int, max_budget: int, kernel: bool = False,
    host: bool | None = None, allot: Allot | None = None,
) -> DraftTree:
    """Best ``budgets[r]`` prefixes of each row's factorized draft distribution, as a tree.

    draft_logits: [R, L, V] per-depth drafter logits (marginals = softmax over V).
    budgets: [R] int64 (or an int for all rows), 0 <= budget <= max_budget; 0 = root only.
    max_budget: B, the static node count; a row with a smaller budget keeps its best ``budgets[r]``
    nodes and its other node slots are padding (invalid: see ``draft_tree``).
    allot: given each row's best ``max_budget`` path log-weights ``[R, B]`` (descending, -inf where
    fewer prefixes exist) and ``budgets`` as caps, the budgets the tree keeps (e.g. the policy's
    per-row allotment, ``policy/row_budgets.py``); every path below gives it the same weights.
    kernel: compute the per-depth kept lists, then the tree, with two Triton kernels per row
    (``models/tree_kernels.expand_levels`` and ``select_nodes``; same result) where they can run:
    float32 log-probs on CUDA with Triton (or the interpreter). The engine turns it on with its
    ``triton_tree`` option.
    host: after the top-k, build the tree with numpy on the host (``host.py``; same tree), for
    CPU tensors only. None: for CPU tensors with max_budget <= ``HOST_MAX_BUDGET`` and rows x max_budget
    <= ``HOST_MAX_ROW_NODES``.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, L, V], got shape {tuple(draft_logits.shape)}")
    if max_budget < 0:
        raise ValueError(f"max_budget must be >= 0, got {max_budget}")
    num_rows, depth, vocab = draft_logits.shape
    device = draft_logits.device
    budgets = _as_budgets(budgets, num_rows, device)  # [R]
    if max_budget == 0 or depth == 0:
        return _root_only(num_rows, max_budget, draft_logits)
    top_logp, top_tokens = _top_tokens(draft_logits, min(max_budget, vocab))  # [R, L, K] x2
    if host is None:
        host = device.type == "cpu" and max_budget <= HOST_MAX_BUDGET and num_rows * max_budget <= HOST_MAX_ROW_NODES
    elif host and device.type != "cpu":
        raise ValueError(f"host=True builds trees of CPU tensors only, got draft_logits on {device}")
    if host:
        return tree_host.build_tree_on_host(top_logp, top_tokens, budgets, max_budget, allot)
    if kernel and top_logp.dtype == torch.float32 and gpu_kernels.usable_on(top_logp):
        pairs = _kernel_pairs(max_budget, top_logp.shape[2], device)  # [M] x2
        weights, parents, tokens = tree_kernels.expand_levels(top_logp, top_tokens, max_budget, *pairs)  # [R, L, B] x3
        if depth * max_budget <= SELECT_KERNEL_MAX_NODES:
            if allot is not None:  # the kept lists' best B weights (float32: the same as any path ranks)
                ranked = torch.topk(weights.reshape(num_rows, -1), max_budget, dim=1).values  # [R, B]
                budgets = allot(ranked, budgets)  # [R]
            return DraftTree(*tree_kernels.select_nodes(weights, parents, tokens, budgets, max_budget))
        levels = [_Level(weights[:, d], parents[:, d], tokens[:, d]) for d in range(depth)]
    else:
        levels = _expand_levels(top_logp, top_tokens, max_budget)
    return _select_nodes(levels, budgets, max_budget, allot)


# CPU trees are built on the host by default (host.py) up to this budget and rows x budget, the
# crossover on a 2-core EPYC: the host path is 1.5-1.6x faster at 1 row and budget 2-32, 1.0-1.1x at
# 32 rows and budget 4-8, and slower at budget 64
HOST_MAX_BUDGET = 32
HOST_MAX_ROW_NODES = 256

# depth x budget up to which the kernel path also selects the nodes in one kernel (it holds that
# many weights per row in registers; beyond it the torch ops below do it)
SELECT_KERNEL_MAX_NODES = 8192


def _as_budgets(budgets: torch.Tensor | int, num_rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(budgets, int):
        return torch.full((num_rows,), budgets, dtype=torch.long, device=device)  # [R]
    if budgets.shape != (num_rows,):
        raise ValueError(f"budgets must be [R] = [{num_rows}], got shape {tuple(budgets.shape)}")
    return budgets.to(device=device, dtype=torch.long)  # [R]


def _top_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens per depth with their log-probabilities, best first (rank order).

    Where the Triton kernels run: bf16 / fp16 logits take an exact radix select over their 16-bit
    order keys that also computes the log-normalizer (``topk_kernels.top_log_probs``; equal values
    in token order); other dtypes take ``torch.topk`` on the logits as they are and the Triton
    log-normalizer (``topk_kernels.log_normalize_top``), without a float32 copy of every logit.
    Both tree paths (kernel or not) use the same top-k, so they see the same log-probs."""
    if gpu_kernels.usable_on(draft_logits) and draft_logits.dtype in (torch.bfloat16, torch.float16):
        return topk_kernels.top_log_probs(draft_logits, k)
    top = torch.topk(draft_logits, k, dim=-1, largest=True, sorted=True)  # [R, L, K] x2
    if gpu_kernels.usable_on(draft_logits) and draft_logits.dtype != torch.float64:
        return topk_kernels.log_normalize_top(draft_logits, top.values), top.indices
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    log_norm = torch.logsumexp(draft_logits.to(dtype), dim=-1, keepdim=True)  # [R, L, 1]
    return top.values.to(dtype) - log_norm, top.indices  # [R, L, K] float, [R, L, K] int64


def _expand_levels(
    top_logp: torch.Tensor, top_tokens: torch.Tensor, max_budget: int
) -> list[_Level]:
    """Kept lists for depths 1..L; each is the best B prefixes of its depth (exact).

    Depth d's candidates are the [B, K] matrix ``kept (d-1) x top-K of depth d``. Its best B
    are found without a top-k over all B*K entries: a top-k over the short prefilter list
    (see :func:`_prefilter_pairs`) gives the B-th best weight (the threshold) exactly, and one
    pass over the matrix keeps what beats it plus the lexicographically first ties. Above
    ``PREFILTER_MAX_ROW_NODES`` rows x budget, one int64-key top-k over the whole matrix does it.
    """
    num_rows, depth, k = top_logp.shape
    level = _first_level(top_logp[:, 0], top_tokens[:, 0], max_budget)
    levels = [level]
    by_key = num_rows * max_budget > PREFILTER_MAX_ROW_NODES
    if not by_key:
        sorted_w = _sorted_desc(level.log_weights, top_logp[:, 0])  # [R, B]
        pair_row, pair_rank = _prefilter_pairs(max_budget, k, top_logp.device)  # [M] x2
        pair_logp = top_logp[:, :, pair_rank]  # [R, L, M]
    for d in range(1, depth):
        candidates = level.log_weights[:, :, None] + top_logp[:, d, None, :]  # [R, B, K]
        if by_key:
            flat = _best_flat_by_key(candidates.reshape(num_rows, -1), max_budget)  # [R, B]
        else:  # the B best of the prefilter list hold the B best weights of the whole matrix
            best_values = torch.topk(sorted_w[:, pair_row] + pair_logp[:, d], max_budget, dim=1).values  # [R, B]
            flat = _best_flat(candidates.reshape(num_rows, -1), best_values, max_budget)  # [R, B]
        level = _Level(
            candidates.reshape(num_rows, -1).gather(1, flat),
            flat // k,
            top_tokens[:, d, :].gather(1, flat % k),
        )
        levels.append(level)
        if not by_key:
            sorted_w = _sorted_desc(level.log_weights, best_values)
    return levels


# rows x budget above which one top-k over every candidate (int64 keys) beats the prefilter plus
# the full-matrix threshold pass (on an H200 the prefilter is faster at 1 x 16..1024 and 8 x 16..64,
# slower at 8 x 256 and 8 x 1024)
PREFILTER_MAX_ROW_NODES = 1024


def _best_flat_by_key(weights: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` best weights, ascending [R, count], by one top-k on an int64
    key: the weight's order-preserving float32 bits above the reversed index, so ties go to the
    lower index (as in _best_flat)."""
    bits = weights.float().view(torch.int32).long()  # [R, M] sign-extended
    order_bits = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # negative floats count downwards
    later_first = torch.arange(weights.shape[1], 0, -1, device=weights.device)  # [M]
    picked = torch.topk((order_bits << 32) | later_first, count, dim=1, sorted=False).indices  # [R, count]
    return picked.sort(dim=1).values


def _first_level(logp: torch.Tensor, tokens: torch.Tensor, max_budget: int) -> _Level:
    """Depth 1: the top-K tokens themselves (rank order is lex order), -inf padded to B.

    logp, tokens: [R, K]. Equals the general step on the root-only kept list.
    """
    missing = max_budget - logp.shape[1]
    log_weights = F.pad(logp, (0, missing), value=float("-inf"))  # [R, B]
    return _Level(log_weights, torch.zeros_like(log_weights, dtype=torch.long),
                  F.pad(tokens, (0, missing)))


def _sorted_desc(log_weights: torch.Tensor, sorted_values: torch.Tensor) -> torch.Tensor:
    """A kept list's weights in descending order, [R, B].

    ``sorted_values`` are the top-k values the list was cut from: for float32 weights they are
    the same multiset (ties at the threshold are equal), so no sort is needed. Wider weights
    can differ below float32 precision among threshold ties: sort them.
    """
    if log_weights.dtype == torch.float32:
        missing = log_weights.shape[1] - sorted_values.shape[1]
        return F.pad(sorted_values, (0, missing), value=float("-inf")) if missing else sorted_values
    return torch.sort(log_weights, dim=1, descending=True).values


@functools.lru_cache(maxsize=None)
def _prefilter_pairs(max_budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Static (row, rank) pairs with (row + 1) * (rank + 1) <= B, ~B ln B of them.

    Sort the kept weights s descending and the log-probs l descending: the candidate matrix
    s_i + l_j is then non-increasing along both axes (float rounding is monotone), so entry
    (i, j) has (i + 1) * (j + 1) - 1 entries >= it. An entry outside the list therefore never
    beats the B-th best weight, and the B best weights of the list are those of the whole
    matrix (any B cells closed under "smaller i or j" lie inside the list). Only which of the
    entries tied at the B-th weight are kept is decided outside the list (see _best_flat):
    ties can sit anywhere, since rounding can make s_a + l equal s_b + l for s_a > s_b.
    Returns pair_row, pair_rank: [M] int64, built on the device (no host copy, capturable).
    """
    rank = torch.arange(k, device=device)  # [K]
    rows_per_rank = torch.clamp(max_budget // (rank + 1), max=max_budget)  # [K]
    size = sum(min(max_budget, max_budget // (j + 1)) for j in range(k))  # M (host arithmetic)
    pair_rank = torch.repeat_interleave(rank, rows_per_rank, output_size=size)  # [M]
    first = rows_per_rank.cumsum(0) - rows_per_rank  # [K]; where each rank's run starts
    pair_row = torch.arange(size, device=device) - first[pair_rank]  # [M]
    return pair_row, pair_rank


@functools.lru_cache(maxsize=None)
def _kernel_pairs(max_budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`_prefilter_pairs` as int32, the kept-list kernel's index type (converted once, not
    every round)."""
    return tuple(pairs.to(torch.int32) for pairs in _prefilter_pairs(max_budget, k, device))


def _best_flat(weights: torch.Tensor, top_values: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` best weights, ties to the lower index, ascending. [R, count]

    weights: [R, M] in index (lex) order. top_values: [R, count] the ``count`` largest weights,
    descending (any tie order). Same result as the int64-key top-k of the reference: keep all
    weights above the threshold (float32 order, like the key) and the first ties at it.
    """
    top32 = top_values.float()  # [R, count]
    threshold = top32[:, -1:]  # [R, 1]
    need = count - (top32 > threshold).sum(dim=1, keepdim=True)  # [R, 1]; ties to keep
    weights32 = weights.float()  # [R, M]
    tied = weights32 == threshold  # [R, M]
    keep = (weights32 > threshold) | (tied & (tied.cumsum(dim=1) <= need))  # [R, M]; count each
    slot = keep.cumsum(dim=1) - 1  # [R, M]; place among the kept, in index order
    slot = torch.where(keep, slot, count)  # [R, M]; the rest go to a dump column
    index = torch.arange(weights.shape[1], device=weights.device).expand_as(slot)  # [R, M]
    flat = torch.zeros(weights.shape[0], count + 1, dtype=torch.long, device=weights.device)
    return flat.scatter_(1, slot, index)[:, :count]  # [R, count]


def _select_nodes(levels: list[_Level], budgets: torch.Tensor, max_budget: int, allot: Allot | None = None
                  ) -> DraftTree:
    """Best ``budget`` prefixes over all depths, laid out as the node axis of a DraftTree
    (``allot``: see :func:`build_tree`)."""
    depth = len(levels)
    device = budgets.device
    all_w = torch.cat([lv.log_weights for lv in levels], dim=1)  # [R, L*B]; (depth, lex) order
    all_parent = torch.cat([lv.parent_pos for lv in levels], dim=1)  # [R, L*B]
    all_tokens = torch.cat([lv.tokens for lv in levels], dim=1)  # [R, L*B]
    # Best B over all depths; ties go to the lower flat index = shallower, then lex smaller.
    top_values = torch.topk(all_w, max_budget, dim=1).values  # [R, B]
    chosen = _best_flat(all_w, top_values, max_budget)  # [R, B]
    # Rank order (weight desc, stable): the first `budget` existing ones are the tree.
    by_weight = torch.sort(all_w.gather(1, chosen), dim=1, descending=True, stable=True)
    ranked = chosen.gather(1, by_weight.indices)  # [R, B]
    if allot is not None:
        budgets = allot(by_weight.values, budgets)  # [R]
    rank = torch.arange(max_budget, device=device)  # [B]
    valid = (rank[None, :] < budgets[:, None]) & (by_weight.values > float("-inf"))  # [R, B]
    node_depth = ranked // max_budget + 1  # [R, B]
    # Layout: valid nodes by depth (stable keeps weight desc, then lex), invalid ones last.
    layout_key = torch.where(valid, node_depth, depth + 1)  # [R, B]
    layout = torch.sort(layout_key, dim=1, stable=True).indices  # [R, B]
    node_flat = ranked.gather(1, layout)  # [R, B]
    valid = valid.gather(1, layout)  # [R, B]
    node_depth = node_depth.gather(1, layout)  # [R, B]
    parents = _parent_nodes(node_flat, node_depth, all_parent, max_budget)  # [R, B]
    return _assemble(
        tokens=all_tokens.gather(1, node_flat),
        parents=parents,
        depths=node_depth,
        valid=valid,
        log_weights=all_w.gather(1, node_flat),
        max_depth=depth,
    )


def _parent_nodes(
    node_flat: torch.Tensor, node_depth: torch.Tensor, all_parent: torch.Tensor, max_budget: int
) -> torch.Tensor:
    """Node-axis index of each node's parent (ROOT for depth 1).

    node_flat: [R, B] place of node k+1 in the (depth, kept) flat list. Returns [R, B].
    """
    num_rows, flat_size = all_parent.shape
    node_index = torch.arange(1, max_budget + 1, device=node_flat.device)  # [B]
    flat_to_node = torch.zeros(num_rows, flat_size, dtype=torch.long, device=node_flat.device)
    flat_to_node.scatter_(1, node_flat, node_index.expand(num_rows, -1))  # [R, L*B]
    parent_pos = all_parent.gather(1, node_flat)  # [R, B]
    parent_flat = ((node_depth - 2) * max_budget + parent_pos).clamp(min=0)  # [R, B]
    parent_node = flat_to_node.gather(1, parent_flat)  # [R, B]
    return torch.where(node_depth == 1, ROOT, parent_node)  # [R, B]


def _assemble(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    valid: torch.Tensor,
    log_weights: torch.Tensor,
    max_depth: int,
) -> DraftTree:
    """Prepend the root, blank out invalid nodes and build the ancestor mask.

    Inputs are [R, B] for nodes 1..B; outputs are [R, B+1].
    """
    num_rows = tokens.shape[0]
    device = tokens.device
    ones = torch.ones(num_rows, 1, dtype=torch.long, device=device)  # [R, 1]
    tokens = torch.cat([ones * ROOT_TOKEN, torch.where(valid, tokens, PAD_TOKEN)], 1)
    parents = torch.cat([ones * NO_PARENT, torch.where(valid, parents, ROOT)], 1)
    depths = torch.cat([ones * 0, torch.where(valid, depths, 0)], 1)
    valid = torch.cat([ones.bool(), valid], 1)  # [R, B+1]
    root_w = torch.zeros(num_rows, 1, dtype=log_weights.dtype, device=device)  # [R, 1]
    log_weights = torch.cat([root_w, log_weights.masked_fill(~valid[:, 1:], float("-inf"))], 1)
    mask = ancestor_mask(parents, valid, max_depth)  # [R, B+1, B+1]
    return DraftTree(tokens, parents, depths, valid, mask, log_weights)


def ancestor_mask(parents: torch.Tensor, valid: torch.Tensor, max_depth: int) -> torch.Tensor:
    """mask[r, i, j] = j == i or j is an ancestor of i; invalid nodes see only themselves.

    parents, valid: [R, N]. Pointer doubling: ``path[:, i, t]`` is the t-th ancestor of i
    (the root, and invalid nodes, are their own parents, so paths end in a fixed point);
    each step appends the paths of the nodes 2^s levels up, so ceil(log2(L + 1)) steps cover
    every ancestor. One scatter then writes the mask.
    """
    num_rows, size = parents.shape
    node = torch.arange(size, device=parents.device).expand(num_rows, -1)  # [R, N]
    inherits = valid.clone()  # [R, N]
    inherits[:, ROOT] = False
    jump = torch.where(inherits, parents, node)  # [R, N]; ancestor 2^s levels up
    path = node[:, :, None]  # [R, N, 1]
    while path.shape[2] < max_depth + 1:
        width = path.shape[2]
        upper = path.gather(1, jump[:, :, None].expand(-1, -1, width))  # [R, N, width]
        path = torch.cat([path, upper], dim=2)  # [R, N, 2 * width]
        jump = jump.gather(1, jump)  # [R, N]
    mask = torch.zeros(num_rows, size, size, dtype=torch.bool, device=parents.device)
    return mask.scatter_(2, path, True)  # [R, N, N]


def _root_only(num_rows: int, max_budget: int, draft_logits: torch.Tensor) -> DraftTree:
    """A tree whose only valid node is the root (B padded nodes)."""
    device = draft_logits.device
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    zeros = torch.zeros(num_rows, max_budget, dtype=torch.long, device=device)  # [R, B]
    return _assemble(
        tokens=zeros,
        parents=zeros,
        depths=zeros,
        valid=zeros.bool(),
        log_weights=torch.zeros(num_rows, max_budget, dtype=dtype, device=device),
        max_depth=0,
    )
