"""CUDA only: the Triton tree kernels (kept lists, node selection, walk, commit) against the torch
path when a round's rows keep different numbers of nodes (tests/support/row_budget_kernel_checks.py)."""

import pytest
import torch

from tests.support.row_budget_kernel_checks import compare_trees


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_kernels_take_per_row_budgets_on_cuda():
    result = compare_trees("cuda", cases=120)
    assert result.pop("row_budgets/rounds_with_mixed_sizes") >= 60
    assert not any(result.values()), result
