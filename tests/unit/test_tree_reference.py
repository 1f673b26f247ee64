"""build_tree / accept_walk against frozen copies of their previous implementations.

The fast versions (prefiltered top-k, threshold selection, pointer-doubling mask, loop-free
walk) must give bit-identical outputs: same node set, order, tie-breaks, weights and masks.
``_reference_build_tree`` and ``_reference_accept_walk`` (tests/support/tree_reference.py) are
the code as it was before (issue #4), kept verbatim apart from names.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashtree.speculative.tree import NO_PARENT, DraftTree, build_tree
from flashtree.speculative.tree import build as tree_module
from flashtree.speculative.verify import AcceptResult, accept_walk
from tests.support.tree_reference import (
    _ref_expand_levels,
    _reference_accept_walk,
    _reference_build_tree,
    assert_same_tree,
    make_logits,
)

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
    mask = tree_module.ancestor_mask(parents, valid, 2)
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
