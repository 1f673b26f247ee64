"""Frozen copies of build_tree / accept_walk as they were before issue #4 (prefiltered top-k,
threshold selection, pointer-doubling mask, loop-free walk), kept verbatim apart from names: the
fast versions must give bit-identical outputs (tests/unit/test_tree_reference.py, the kernel
checks), and benchmarks/tree_build_speed.py times them too. Also the tree comparison and the
random drafter logits those checks use."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.speculative.tree import NO_PARENT, PAD_TOKEN, ROOT, ROOT_TOKEN, DraftTree
from flashtree.speculative.verify import PATH_PAD, AcceptResult

# ---------------------------------------------------------------- frozen reference (before #4)

class _ref_Level(NamedTuple):
    """The kept list of one depth: B prefixes in lexicographic rank order."""

    log_weights: torch.Tensor  # [R, B] float; -inf for prefixes that do not exist
    parent_pos: torch.Tensor  # [R, B] int64; place of the parent in the previous kept list
    tokens: torch.Tensor  # [R, B] int64


def _reference_build_tree(
    draft_logits: torch.Tensor, budgets: torch.Tensor | int, max_budget: int
) -> DraftTree:
    """Best ``budgets[r]`` prefixes of each row's factorized draft distribution, as a tree.

    draft_logits: [R, L, V] per-depth drafter logits (marginals = softmax over V).
    budgets: [R] int64 (or an int for all rows), 0 <= budget <= max_budget; 0 = root only.
    max_budget: B, the static node count.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, L, V], got shape {tuple(draft_logits.shape)}")
    if max_budget < 0:
        raise ValueError(f"max_budget must be >= 0, got {max_budget}")
    num_rows, depth, vocab = draft_logits.shape
    device = draft_logits.device
    budgets = _ref_as_budgets(budgets, num_rows, device)  # [R]
    if max_budget == 0 or depth == 0:
        return _ref_root_only(num_rows, max_budget, draft_logits)
    top_logp, top_tokens = _ref_top_tokens(draft_logits, min(max_budget, vocab))  # [R, L, K] x2
    levels = _ref_expand_levels(top_logp, top_tokens, max_budget)
    return _ref_select_nodes(levels, budgets, max_budget)


def _ref_as_budgets(budgets: torch.Tensor | int, num_rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(budgets, int):
        return torch.full((num_rows,), budgets, dtype=torch.long, device=device)  # [R]
    if budgets.shape != (num_rows,):
        raise ValueError(f"budgets must be [R] = [{num_rows}], got shape {tuple(budgets.shape)}")
    return budgets.to(device=device, dtype=torch.long)  # [R]


def _ref_top_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens per depth with their log-probabilities, best first (rank order)."""
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    logits = draft_logits.to(dtype)  # [R, L, V]
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, L, 1]
    top = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    return top.values - log_norm, top.indices  # [R, L, K] float, [R, L, K] int64


def _ref_expand_levels(
    top_logp: torch.Tensor, top_tokens: torch.Tensor, max_budget: int
) -> list[_ref_Level]:
    """Kept lists for depths 1..L; each is the best B prefixes of its depth (exact)."""
    num_rows, depth, k = top_logp.shape
    # The root as a depth-0 kept list: one prefix of weight 0, the rest absent.
    kept = torch.full((num_rows, max_budget), float("-inf"), dtype=top_logp.dtype,
                      device=top_logp.device)  # [R, B]
    kept[:, 0] = 0.0
    levels = []
    for d in range(depth):
        candidates = kept[:, :, None] + top_logp[:, d, None, :]  # [R, B, K]
        # Flat index p*K + rank is lexicographic order, because the kept list is.
        flat = _ref_best_in_index_order(candidates.reshape(num_rows, -1), max_budget)  # [R, B]
        kept = candidates.reshape(num_rows, -1).gather(1, flat)  # [R, B]
        tokens = top_tokens[:, d, :].gather(1, flat % k)  # [R, B]
        levels.append(_ref_Level(kept, flat // k, tokens))
    return levels


def _ref_best_in_index_order(weights: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest weights per row, ties to the lower index.

    weights: [R, M] with M >= count. Returns [R, count] int64 in ascending index order.
    One top-k on an int64 key that holds the weight's order-preserving bits above the reversed
    index, so equal weights rank by index exactly and top-k itself never meets a tie.
    """
    size = weights.shape[1]
    order_bits = _ref_order_preserving_bits(weights)  # [R, M] int64, same order as weights
    later_first = torch.arange(size, 0, -1, device=weights.device)  # [M]; size .. 1
    key = (order_bits << 32) | later_first  # [R, M]
    picked = torch.topk(key, count, dim=1, sorted=False).indices  # [R, count]
    return picked.sort(dim=1).values  # [R, count]


def _ref_order_preserving_bits(weights: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like the float weights (float32 precision; -inf lowest)."""
    bits = weights.float().view(torch.int32).long()  # [R, M] sign-extended
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # negative floats count downwards


def _ref_select_nodes(levels: list[_ref_Level], budgets: torch.Tensor, max_budget: int) -> DraftTree:
    """Best ``budget`` prefixes over all depths, laid out as the node axis of a DraftTree."""
    depth = len(levels)
    device = budgets.device
    all_w = torch.cat([lv.log_weights for lv in levels], dim=1)  # [R, L*B]; (depth, lex) order
    all_parent = torch.cat([lv.parent_pos for lv in levels], dim=1)  # [R, L*B]
    all_tokens = torch.cat([lv.tokens for lv in levels], dim=1)  # [R, L*B]
    # Best B over all depths; ties go to the lower flat index = shallower, then lex smaller.
    chosen = _ref_best_in_index_order(all_w, max_budget)  # [R, B]
    # Rank order (weight desc, stable): the first `budget` existing ones are the tree.
    by_weight = torch.sort(all_w.gather(1, chosen), dim=1, descending=True, stable=True)
    ranked = chosen.gather(1, by_weight.indices)  # [R, B]
    rank = torch.arange(max_budget, device=device)  # [B]
    valid = (rank[None, :] < budgets[:, None]) & (by_weight.values > float("-inf"))  # [R, B]
    node_depth = ranked // max_budget + 1  # [R, B]
    # Layout: valid nodes by depth (stable keeps weight desc, then lex), invalid ones last.
    layout_key = torch.where(valid, node_depth, depth + 1)  # [R, B]
    layout = torch.sort(layout_key, dim=1, stable=True).indices  # [R, B]
    node_flat = ranked.gather(1, layout)  # [R, B]
    valid = valid.gather(1, layout)  # [R, B]
    node_depth = node_depth.gather(1, layout)  # [R, B]
    parents = _ref_parent_nodes(node_flat, node_depth, all_parent, max_budget)  # [R, B]
    return _ref_assemble(
        tokens=all_tokens.gather(1, node_flat),
        parents=parents,
        depths=node_depth,
        valid=valid,
        log_weights=all_w.gather(1, node_flat),
        max_depth=depth,
    )


def _ref_parent_nodes(
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


def _ref_assemble(
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
    mask = _ref_ancestor_mask(parents, valid, max_depth)  # [R, B+1, B+1]
    return DraftTree(tokens, parents, depths, valid, mask, log_weights)


def _ref_ancestor_mask(parents: torch.Tensor, valid: torch.Tensor, max_depth: int) -> torch.Tensor:
    """mask[r, i, j] = j == i or j is an ancestor of i; invalid nodes see only themselves.

    parents, valid: [R, N]. After step s every node of depth <= s is exact, since
    mask(node) = mask(parent) | self; max_depth steps of batched row gathers.
    """
    num_rows, size = parents.shape
    self_mask = torch.eye(size, dtype=torch.bool, device=parents.device).expand(num_rows, -1, -1)
    inherits = valid.clone()  # [R, N]
    inherits[:, ROOT] = False
    parent_rows = parents.clamp(min=0)[:, :, None].expand(-1, -1, size)  # [R, N, N]
    mask = self_mask.clone()  # [R, N, N]
    for _ in range(max_depth):
        from_parent = mask.gather(1, parent_rows) & inherits[:, :, None]  # [R, N, N]
        mask = self_mask | from_parent
    return mask


def _ref_root_only(num_rows: int, max_budget: int, draft_logits: torch.Tensor) -> DraftTree:
    """A tree whose only valid node is the root (B padded nodes)."""
    device = draft_logits.device
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    zeros = torch.zeros(num_rows, max_budget, dtype=torch.long, device=device)  # [R, B]
    return _ref_assemble(
        tokens=zeros,
        parents=zeros,
        depths=zeros,
        valid=zeros.bool(),
        log_weights=torch.zeros(num_rows, max_budget, dtype=dtype, device=device),
        max_depth=0,
    )


def _reference_accept_walk(
    tree: DraftTree, target_choice: torch.Tensor, max_depth: int | None = None
) -> AcceptResult:
    """Walk each row's tree along the target's choices, without host syncs.

    tree: a DraftTree with N nodes per row. target_choice: [R, N] int64.
    max_depth: deepest node depth (L for DDTree / DFlash); defaults to N - 1, always enough.
    """
    num_rows, num_nodes = tree.tokens.shape
    if target_choice.shape != (num_rows, num_nodes):
        raise ValueError(
            f"target_choice must be [R, N] = [{num_rows}, {num_nodes}], "
            f"got shape {tuple(target_choice.shape)}"
        )
    if max_depth is None:
        max_depth = num_nodes - 1
    device = tree.tokens.device
    target_choice = target_choice.long()
    node_index = torch.arange(num_nodes, device=device)  # [N]
    walkable = tree.valid & (node_index != ROOT)  # [R, N]
    current = torch.full((num_rows,), ROOT, dtype=torch.long, device=device)  # [R]
    moving = torch.ones(num_rows, dtype=torch.bool, device=device)  # [R]
    steps = [current]
    for _ in range(max_depth):
        choice = target_choice.gather(1, current[:, None])  # [R, 1]
        match = walkable & (tree.parents == current[:, None]) & (tree.tokens == choice)  # [R, N]
        moving = moving & match.any(dim=1)  # [R]
        child = match.long().argmax(dim=1)  # [R]; first (only) match
        current = torch.where(moving, child, current)  # [R]
        steps.append(torch.where(moving, child, PATH_PAD))
    path = torch.stack(steps, dim=1)  # [R, P]
    on_path = path != PATH_PAD  # [R, P]
    path_tokens = tree.tokens.gather(1, path.clamp(min=0))  # [R, P]
    return AcceptResult(
        path=path,
        accept_lengths=on_path.sum(dim=1),
        next_bonus=target_choice.gather(1, current[:, None]).squeeze(1),
        committed_tokens=torch.where(on_path, path_tokens, PATH_PAD),
    )


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    for name, x, y in zip(DraftTree._fields, got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


def make_logits(kind: str, rows: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Random drafter logits; the int kinds are heavily tied (quantized) on purpose."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "int6":  # 6 levels: many exact ties, and near-ties after rounding of sums
        return torch.randint(0, 6, (rows, depth, vocab), generator=gen).float()
    if kind == "int2":  # 2 levels: huge tie groups
        return torch.randint(0, 2, (rows, depth, vocab), generator=gen).float() * 3.0
    logits = torch.randn(rows, depth, vocab, generator=gen, dtype=torch.float64) * 2.0
    return {"f64": logits, "f32": logits.float(), "bf16": logits.bfloat16()}[kind]
