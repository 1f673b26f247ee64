"""DDTree build: optimality against plain-Python oracles, structure, batching, budgets."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest
import torch

from flashtree.speculative.tree import DraftTree, build_tree, chain_tree

Prefixes = dict[tuple[int, ...], float]  # token prefix -> log weight


# ---------------------------------------------------------------- oracles (plain Python)


def _log_probs(logits: torch.Tensor) -> list[list[float]]:
    """[L, V] logits -> per-depth log-probabilities as Python lists."""
    return torch.log_softmax(logits.double(), dim=-1).tolist()


def heap_oracle(logits: torch.Tensor, budget: int) -> Prefixes:
    """Best-first enumeration: pop the best prefix, push its next sibling and first child."""
    logp = _log_probs(logits)
    depth, vocab = len(logp), len(logp[0])
    order = [sorted(range(vocab), key=lambda t: -row[t]) for row in logp]  # rank -> token

    def weight(ranks: tuple[int, ...]) -> float:
        return sum(logp[d][order[d][r]] for d, r in enumerate(ranks))

    heap = [(-weight((0,)), (0,))]
    out: Prefixes = {}
    while heap and len(out) < budget:
        neg_w, ranks = heapq.heappop(heap)
        out[tuple(order[d][r] for d, r in enumerate(ranks))] = -neg_w
        if ranks[-1] + 1 < vocab:
            sibling = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-weight(sibling), sibling))
        if len(ranks) < depth:
            child = ranks + (0,)
            heapq.heappush(heap, (-weight(child), child))
    return out


def brute_force(logits: torch.Tensor, budget: int) -> Prefixes:
    """Every prefix of every depth, sorted by weight; the best `budget` of them."""
    logp = _log_probs(logits)
    depth, vocab = len(logp), len(logp[0])
    every = [
        (sum(logp[i][t] for i, t in enumerate(prefix)), prefix)
        for d in range(1, depth + 1)
        for prefix in itertools.product(range(vocab), repeat=d)
    ]
    every.sort(key=lambda item: -item[0])
    return {prefix: w for w, prefix in every[:budget]}


def tree_prefixes(tree: DraftTree, row: int) -> Prefixes:
    """The valid nodes of one row as token prefixes (walking parent pointers)."""
    tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
    out: Prefixes = {}
    for node in range(1, len(tokens)):
        if not tree.valid[row, node]:
            continue
        prefix, walk = [], node
        while walk != 0:
            prefix.append(tokens[walk])
            walk = parents[walk]
        out[tuple(reversed(prefix))] = float(tree.log_weights[row, node])
    return out


def assert_same_prefixes(got: Prefixes, want: Prefixes) -> None:
    assert set(got) == set(want)
    for prefix, w in want.items():
        assert math.isclose(got[prefix], w, rel_tol=1e-12, abs_tol=1e-12), prefix


def check_structure(tree: DraftTree, budgets: list[int]) -> None:
    """Layout invariants every DraftTree row must satisfy."""
    num_rows, num_nodes = tree.tokens.shape
    for r in range(num_rows):
        valid = tree.valid[r].tolist()
        parents, depths = tree.parents[r].tolist(), tree.depths[r].tolist()
        weights, tokens = tree.log_weights[r].tolist(), tree.tokens[r].tolist()
        count = sum(valid) - 1
        assert count <= budgets[r]
        assert valid == [True] * (count + 1) + [False] * (num_nodes - count - 1)
        assert parents[0] == -1 and depths[0] == 0 and weights[0] == 0.0
        children: dict[int, list[int]] = {}
        for node in range(1, num_nodes):
            if not valid[node]:
                assert parents[node] == 0 and weights[node] == -math.inf
                assert tree.ancestor_mask[r, node].nonzero().flatten().tolist() == [node]
                continue
            parent = parents[node]
            assert 0 <= parent < node and valid[parent]
            assert depths[node] == depths[parent] + 1
            assert weights[node] <= weights[parent]
            children.setdefault(parent, []).append(tokens[node])
            # Layout: depth ascending, then weight descending.
            if node > 1:
                assert (depths[node - 1], -weights[node - 1]) <= (depths[node], -weights[node])
            ancestors, walk = {node}, node
            while walk != 0:
                walk = parents[walk]
                ancestors.add(walk)
            assert set(tree.ancestor_mask[r, node].nonzero().flatten().tolist()) == ancestors
        assert tree.ancestor_mask[r, 0].nonzero().flatten().tolist() == [0]
        for siblings in children.values():
            assert len(siblings) == len(set(siblings))


def random_logits(seed: int, rows: int, depth: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, depth, vocab, generator=generator, dtype=torch.float64) * 2.0


# ---------------------------------------------------------------- optimality


@pytest.mark.parametrize("vocab", [50, 128, 512])
@pytest.mark.parametrize("depth", [1, 3, 7, 15])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_heap_oracle(vocab: int, depth: int, seed: int) -> None:
    budgets = [0, 1, depth, 3 * depth, 200]
    logits = random_logits(seed, len(budgets), depth, vocab)
    for r, budget in enumerate(budgets):  # each row alone, max_budget = its budget
        tree = build_tree(logits[r : r + 1], budget, budget)
        assert_same_prefixes(tree_prefixes(tree, 0), heap_oracle(logits[r], budget))
    # All rows in one batch under a larger static budget.
    tree = build_tree(logits, torch.tensor(budgets), 256)
    check_structure(tree, budgets)
    for r, budget in enumerate(budgets):
        assert_same_prefixes(tree_prefixes(tree, r), heap_oracle(logits[r], budget))


@pytest.mark.parametrize("vocab", [4, 5, 6])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_matches_brute_force(vocab: int, depth: int) -> None:
    total = sum(vocab**d for d in range(1, depth + 1))
    logits = random_logits(vocab * 10 + depth, 1, depth, vocab)
    for budget in range(total + 3):
        tree = build_tree(logits, budget, budget)
        assert_same_prefixes(tree_prefixes(tree, 0), brute_force(logits[0], budget))
        check_structure(tree, [budget])


def test_budget_above_prefix_count_marks_missing_nodes_invalid() -> None:
    logits = random_logits(3, 2, 2, 3)  # 3 + 9 = 12 prefixes
    tree = build_tree(logits, torch.tensor([20, 5]), 20)
    assert tree.valid.sum(dim=1).tolist() == [13, 6]
    check_structure(tree, [20, 5])
    assert_same_prefixes(tree_prefixes(tree, 0), brute_force(logits[0], 12))


# ---------------------------------------------------------------- batching and budgets


def test_batched_rows_equal_rows_built_alone() -> None:
    budgets = [0, 3, 17, 64, 40, 64]
    logits = random_logits(7, len(budgets), 7, 300)
    batched = build_tree(logits, torch.tensor(budgets), 64)
    for r, budget in enumerate(budgets):
        alone = build_tree(logits[r : r + 1], budget, 64)
        for name, got, want in zip(DraftTree._fields, batched, alone):
            assert torch.equal(got[r : r + 1], want), name


def test_int_budget_equals_tensor_budget() -> None:
    logits = random_logits(8, 3, 5, 100)
    a = build_tree(logits, 30, 40)
    b = build_tree(logits, torch.full((3,), 30), 40)
    for name, x, y in zip(DraftTree._fields, a, b):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_budget_monotone(budget: int) -> None:
    logits = random_logits(budget, 4, 15, 200)
    small = build_tree(logits, budget, budget)
    large = build_tree(logits, 2 * budget, 2 * budget)
    for r in range(4):
        assert set(tree_prefixes(small, r)) <= set(tree_prefixes(large, r))


def test_budget_zero_is_root_only() -> None:
    logits = random_logits(9, 2, 4, 10)
    for max_budget in (0, 8):
        tree = build_tree(logits, 0, max_budget)
        assert tree.tokens.shape == (2, max_budget + 1)
        assert tree.valid.sum().item() == 2
        check_structure(tree, [0, 0])


# ---------------------------------------------------------------- ties, dtypes, devices


def test_equal_logits_break_ties_shallower_then_lower_rank() -> None:
    logits = torch.zeros(1, 2, 3, dtype=torch.float64)  # every token equally likely
    tree = build_tree(logits, 4, 4)
    assert tree.depths[0].tolist() == [0, 1, 1, 1, 2]  # all of depth 1 before any depth 2
    assert tree.parents[0, 4].item() == 1  # the child of the rank-0 token
    again = build_tree(logits, 4, 4)
    for name, x, y in zip(DraftTree._fields, tree, again):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_logits(dtype: torch.dtype) -> None:
    logits = random_logits(10, 2, 4, 64).to(dtype)
    tree = build_tree(logits, torch.tensor([10, 20]), 20)
    assert tree.log_weights.dtype == torch.float32
    check_structure(tree, [10, 20])


def test_no_host_sync_on_meta_device() -> None:
    """Meta tensors have no data: any .item()/.tolist()/data-dependent shape would fail."""
    logits = torch.empty(4, 15, 49152, device="meta")
    budgets = torch.empty(4, dtype=torch.long, device="meta")
    tree = build_tree(logits, budgets, 256)
    assert tree.tokens.shape == (4, 257) and tree.ancestor_mask.shape == (4, 257, 257)
    assert all(t.device.type == "meta" for t in tree)


# ---------------------------------------------------------------- chain


def test_chain_tree() -> None:
    draft = torch.tensor([[5, 6, 7], [8, 9, 10]])
    tree = chain_tree(draft)
    assert tree.tokens.tolist() == [[-1, 5, 6, 7], [-1, 8, 9, 10]]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2]
    assert tree.depths[0].tolist() == [0, 1, 2, 3]
    assert tree.valid.all()
    assert torch.equal(tree.ancestor_mask[1], torch.ones(4, 4, dtype=torch.bool).tril())
