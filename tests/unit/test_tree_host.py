"""The host-built DDTree (spec/tree_host.py) equals the torch-built one, field by field and bit for bit."""

from __future__ import annotations

import pytest
import torch

from flashtree.speculative.tree.build import HOST_MAX_BUDGET, HOST_MAX_ROW_NODES, DraftTree, build_tree


def assert_same_trees(host: DraftTree, device_ops: DraftTree) -> None:
    for name, got, want in zip(DraftTree._fields, host, device_ops):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


def random_logits(seed: int, rows: int, depth: int, vocab: int, dtype: torch.dtype, ties: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, depth, vocab, generator=generator, dtype=torch.float64) * 2.0
    if ties:  # few distinct values: equal weights across depths, ranks and rows
        logits = (logits * 2).round() / 2
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shape", [(1, 7, 49152), (3, 4, 50), (4, 15, 300), (2, 3, 3)])
def test_host_tree_equals_the_torch_tree(dtype: torch.dtype, ties: bool, shape: tuple[int, int, int]) -> None:
    rows, depth, vocab = shape
    for seed, max_budget in enumerate((1, 2, 4, 7, 16, 64)):
        logits = random_logits(seed, rows, depth, vocab, dtype, ties)
        budgets = torch.randint(0, max_budget + 1, (rows,), generator=torch.Generator().manual_seed(seed))
        budgets[0] = max_budget  # at least one full tree
        assert_same_trees(build_tree(logits, budgets, max_budget, host=True),
                          build_tree(logits, budgets, max_budget, host=False))


def test_host_tree_with_every_logit_equal_and_budget_past_the_prefixes() -> None:
    """All ties (every prefix of a depth weighs the same), and more budget than prefixes (3 + 9)."""
    for logits in (torch.zeros(2, 2, 3), random_logits(5, 2, 2, 3, torch.float32, ties=False)):
        for max_budget in (4, 12, 20):
            assert_same_trees(build_tree(logits, max_budget, max_budget, host=True),
                              build_tree(logits, max_budget, max_budget, host=False))


def test_host_is_the_default_only_for_small_cpu_trees_and_refuses_other_devices(monkeypatch) -> None:
    from flashtree.speculative.tree import host as tree_host

    calls: list[int] = []
    real = tree_host.build_tree_on_host
    monkeypatch.setattr(tree_host, "build_tree_on_host", lambda *a: calls.append(a[3]) or real(*a))
    one_row, many_rows = (random_logits(1, rows, 4, 64, torch.float32, ties=False) for rows in (1, 16))
    build_tree(one_row, 4, 4)
    build_tree(one_row, HOST_MAX_BUDGET, HOST_MAX_BUDGET)
    build_tree(one_row, HOST_MAX_BUDGET + 1, HOST_MAX_BUDGET + 1)  # past the budget limit
    build_tree(many_rows, HOST_MAX_ROW_NODES // 16, HOST_MAX_ROW_NODES // 16)
    build_tree(many_rows, HOST_MAX_ROW_NODES // 16 + 1, HOST_MAX_ROW_NODES // 16 + 1)  # past rows x budget
    assert calls == [4, HOST_MAX_BUDGET, HOST_MAX_ROW_NODES // 16]
    with pytest.raises(ValueError, match="host=True builds trees of CPU tensors only, got draft_logits on meta"):
        build_tree(torch.empty(1, 4, 64, device="meta"), 4, 4, host=True)
