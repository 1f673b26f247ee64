"""Request budgets in adaptive speculation: a round's node count fits the rows' own budgets, and a
capped row does not count in the round's acceptance. (The adaptive engine: tests/integration/test_adaptive_spec.py.)"""

from __future__ import annotations

from flashtree import SamplingParams


def test_request_budgets_cap_the_round_and_the_measurement():
    from flashtree.engine.engine import fit_to_budgets, mean_acceptance
    from flashtree.engine.request import Request
    from flashtree.engine.runner import RoundResult

    ladder = (16, 8, 4, 0)

    def rows(*budgets):
        return [Request(prompt_ids=[1], params=SamplingParams(), budget=b) for b in budgets]

    assert fit_to_budgets(16, rows(None, 2), ladder) == 16  # a row without its own budget
    assert fit_to_budgets(16, rows(5, 2), ladder) == 8  # smallest option holding every budget
    assert fit_to_budgets(16, rows(0, 0), ladder) == 0 and fit_to_budgets(4, rows(9), ladder) == 4
    result = RoundResult(emitted=[[1, 2, 3], [4]], tree_sizes=[8, 2])
    assert mean_acceptance(rows(None, 2), result, 8) == 3.0  # the capped row does not count
    assert mean_acceptance(rows(1, 2), result, 8) is None
