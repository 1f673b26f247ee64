"""The Triton tree kernels agree with the torch and host paths when a round's rows keep different
numbers of nodes (tests/support/row_budget_kernel_checks.py), on the CPU in Triton's interpreter (a
subprocess: the interpreter must be chosen before Triton compiles anything)."""

from __future__ import annotations

from tests.support.interpreter import run_interpreted


def test_tree_kernels_take_per_row_budgets_in_the_triton_interpreter():
    result = run_interpreted("tests.support.row_budget_kernel_checks")
    mixed = result.pop("row_budgets/rounds_with_mixed_sizes")
    assert mixed >= 10, result  # the checks did build rounds whose rows differ in size
    assert not any(result.values()), result
