"""build_tree / accept_walk against frozen copies of their previous implementations.

The fast versions (prefiltered top-k, threshold selection, pointer-doubling mask, loop-free
walk) must give bit-identical outputs: same node set, order, tie-breaks, weights and masks.
``_reference_build_tree`` and ``_reference_accept_walk`` below are the code as it was before
(issue #4), kept verbatim apart from names; benchmarks/tree_build_speed.py times them too.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from flashtree.speculative.tree import build as tree_module
from flashtree.speculative.tree import NO_PARENT, PAD_TOKEN, ROOT, ROOT_TOKEN, DraftTree, build_tree
from flashtree.speculative.verify import PATH_PAD, AcceptResult, accept_walk

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
    num_rows = budgets.shape[0]
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


# ---------------------------------------------------------------- helpers


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


KINDS = ["f64", "f32", "bf16", "int6", "int2"]


# ---------------------------------------------------------------- build_tree


@pytest.fixture(params=["prefilter", "int64_key"])
def selection(request, monkeypatch):
    """Run a test with each per-depth selection (build_tree picks by rows x budget)."""
    monkeypatch.setattr(tree_module, "PREFILTER_MAX_ROW_NODES", 10**9 if request.param == "prefilter" else 0)
    return request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_build_tree_matches_reference(kind: str, seed: int, selection) -> None:
    rng = random.Random(seed * 31 + KINDS.index(kind))
    depth, vocab, rows = rng.randint(1, 15), rng.randint(50, 512), 4
    logits = make_logits(kind, rows, depth, vocab, seed)
    for max_budget in sorted({0, 1, depth, 3 * depth, 64, 200, 256}):
        for budgets in (max_budget, torch.tensor([rng.randint(0, max_budget) for _ in range(rows)])):
            got = build_tree(logits, budgets, max_budget)
            assert_same_tree(got, _reference_build_tree(logits, budgets, max_budget))


@pytest.mark.parametrize("kind", ["f32", "int6"])
def test_build_tree_matches_reference_large_vocab(kind: str, selection) -> None:
    logits = make_logits(kind, 2, 15, 50_000, seed=5)
    budgets = torch.tensor([256, 97])
    assert_same_tree(build_tree(logits, budgets, 256), _reference_build_tree(logits, budgets, 256))


@pytest.mark.parametrize("depth, vocab, max_budget", [(3, 4, 20), (2, 3, 16), (4, 6, 5)])
def test_build_tree_matches_reference_when_budget_exceeds_vocab(depth, vocab, max_budget, selection) -> None:
    for kind in KINDS:
        logits = make_logits(kind, 3, depth, vocab, seed=depth)
        budgets = torch.tensor([max_budget, 0, max_budget // 2])
        got = build_tree(logits, budgets, max_budget)
        assert_same_tree(got, _reference_build_tree(logits, budgets, max_budget))


def test_masked_vocab_matches_reference() -> None:
    logits = make_logits("f32", 3, 6, 300, seed=11)
    logits[:, :, 5:] = float("-inf")  # only 5 tokens exist: most nodes are missing
    logits[1, 2, :] = 0.0  # one depth of exact ties
    budgets = torch.tensor([64, 200, 7])
    assert_same_tree(build_tree(logits, budgets, 200), _reference_build_tree(logits, budgets, 200))


def test_rounding_ties_across_rows_keep_lex_order(selection) -> None:
    """s_a > s_b by one ulp, yet s_a + l == s_b + l after rounding: the tie goes to lex order.

    Depth 2 keeps (0,0), (1,0), (0,1), (1,1) by weight; (1,0) beats (0,1) by one float32 ulp.
    At depth 3 both extend to the same rounded weight, so the lex-smaller (0,1,*) must win the
    last slots, although its row is below (1,0) in weight order (a pure prefilter would lose it).
    """
    below_one = torch.nextafter(torch.tensor(-1.0), torch.tensor(0.0)).item()
    top_logp = torch.tensor([[[0, below_one, -50, -50], [0, -1, -50, -50], [-1.5, -1.5, -50, -50]]])
    top_tokens = torch.arange(4).expand(1, 3, 4).contiguous()
    got = tree_module._expand_levels(top_logp, top_tokens, 4)
    want = _ref_expand_levels(top_logp, top_tokens, 4)
    for level_got, level_want in zip(got, want):
        for x, y in zip(level_got, level_want):
            assert torch.equal(x, y)
    assert want[2].parent_pos.tolist() == [[0, 0, 1, 1]]  # children of (0,0) and (0,1)


def test_prefilter_pairs() -> None:
    for max_budget, k in [(1, 1), (7, 3), (16, 16), (256, 256), (100, 40)]:
        rows, ranks = tree_module._prefilter_pairs(max_budget, k, torch.device("cpu"))
        want = {(i, j) for i in range(max_budget) for j in range(k) if (i + 1) * (j + 1) <= max_budget}
        assert set(zip(rows.tolist(), ranks.tolist())) == want and len(rows) == len(want)


# ---------------------------------------------------------------- accept_walk


def guided_choice(tree: DraftTree, seed: int, follow: float = 0.85) -> torch.Tensor:
    """Target choices that follow a random valid child most of the time (deep paths)."""
    rng = random.Random(seed)
    rows, size = tree.tokens.shape
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    choice = torch.randint(0, 50, (rows, size), generator=torch.Generator().manual_seed(seed))
    for r in range(rows):
        kids: dict[int, list[int]] = {}
        for n in range(1, size):
            if valid[r][n]:
                kids.setdefault(parents[r][n], []).append(n)
        for node, children in kids.items():
            if rng.random() < follow:
                choice[r, node] = tokens[r][rng.choice(children)]
    return choice


def assert_same_walk(got: AcceptResult, want: AcceptResult) -> None:
    for name, x, y in zip(AcceptResult._fields, got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_accept_walk_matches_reference(kind: str, seed: int) -> None:
    depth, vocab, max_budget = 7, 40, 64
    logits = make_logits(kind, 6, depth, vocab, seed)
    budgets = torch.tensor([0, 1, 5, 30, 64, 64])
    tree = build_tree(logits, budgets, max_budget)
    choice = guided_choice(tree, seed)
    for max_depth in (3, None, depth):  # 3 < depth: the walk is cut short
        got = accept_walk(tree, choice, max_depth)
        assert_same_walk(got, _reference_accept_walk(tree, choice, max_depth))
    assert got.accept_lengths.max().item() >= 2  # the walk goes past the root


def test_accept_walk_takes_first_of_duplicate_siblings() -> None:
    # Nodes 1 and 2 are siblings with the same token (not built by build_tree, but allowed).
    tokens = torch.tensor([[99, 5, 5, 7, 8]])
    parents = torch.tensor([[NO_PARENT, 0, 0, 1, 2]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    mask = tree_module._ancestor_mask(parents, valid, 2)
    tree = DraftTree(tokens, parents, depths, valid, mask, torch.zeros(1, 5))
    for choice in ([5, 7, 8, 0, 0], [5, 8, 8, 0, 0], [5, 7, 7, 0, 0]):
        choice = torch.tensor([choice])
        assert_same_walk(accept_walk(tree, choice, 2), _reference_accept_walk(tree, choice, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_matches_reference() -> None:
    logits = make_logits("f32", 4, 15, 151_936, seed=0).cuda()
    budgets = torch.tensor([256, 100, 0, 17], device="cuda")

    def work(lg):
        tree = build_tree(lg, budgets, 256)
        return tree, accept_walk(tree, tree.tokens.roll(-1, dims=1), 15)

    work(logits)  # warm-up (caches, allocator) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree, walk = work(logits)
    graph.replay()
    want = _reference_build_tree(logits, budgets, 256)
    # the Triton log-normalizer (gpu_kernels.log_normalize_top) rounds differently from logsumexp
    assert torch.allclose(tree.log_weights, want.log_weights, rtol=0.0, atol=1e-4)
    assert_same_tree(tree._replace(log_weights=want.log_weights), want)
    assert_same_walk(walk, _reference_accept_walk(want, want.tokens.roll(-1, dims=1), 15))
