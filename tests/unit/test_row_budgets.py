"""Per-row node budgets (policy/row_budgets.py): the allotment of a round's nodes among its rows by
their trees' path probabilities and the round's cost curve, and the cost curve from measurements."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashtree.policy.row_budgets import allot_budgets, cost_curve


def log_probs(rows: list[list[float]], width: int | None = None) -> torch.Tensor:
    """Each row's path probabilities (descending) as log-weights [B, M], -inf padded."""
    width = width or max(len(r) for r in rows)
    out = torch.full((len(rows), width), float("-inf"))
    for b, row in enumerate(rows):
        out[b, :len(row)] = torch.tensor(row).log()
    return out


def ridge_cost(max_tokens: int, ridge: int, flat: float = 1.0, slope: float = 0.05) -> torch.Tensor:
    """Flat up to ``ridge`` tokens, then linear: the shape of a forward on a GPU (DESIGN.md section 10)."""
    t = torch.arange(max_tokens + 1, dtype=torch.float32)
    return flat + slope * (t - ridge).clamp(min=0)


def allot(weights, caps, cost, live=None, padded=False) -> list[int]:
    caps = torch.tensor(caps) if not isinstance(caps, torch.Tensor) else caps
    live = torch.ones(len(caps), dtype=torch.bool) if live is None else torch.tensor(live)
    return allot_budgets(weights, caps, cost, live, padded).tolist()


def ratio(weights: torch.Tensor, budgets: list[int], cost: torch.Tensor, rows: int) -> float:
    """The objective of the ragged layout for given budgets (brute-force reference)."""
    gain = sum(weights[b, :n].exp().sum().item() for b, n in enumerate(budgets))
    tokens = rows + sum(budgets)
    return (rows + gain) / (cost[tokens].item() if tokens < len(cost) else math.inf)


def test_equal_confidence_gets_equal_budgets():
    weights = log_probs([[0.9, 0.6, 0.4, 0.2, 0.1, 0.05]] * 4)
    budgets = allot(weights, [6] * 4, ridge_cost(28, ridge=0, slope=0.2))  # linear: cuts land between tie groups
    assert len(set(budgets)) == 1 and 0 < budgets[0] < 6, budgets
    budgets = allot(weights, [6] * 4, ridge_cost(28, ridge=14))  # a kink inside a tie group: at most one apart
    assert max(budgets) - min(budgets) <= 1, budgets


def test_a_confident_row_gets_more_nodes_than_an_unconfident_one():
    weights = log_probs([[0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4], [0.3, 0.08, 0.05, 0.02, 0.01, 0.01, 0.01, 0.01]])
    budgets = allot(weights, [8, 8], ridge_cost(18, ridge=2, slope=0.08))
    assert budgets[0] > budgets[1], budgets
    assert budgets[0] >= 6 and budgets[1] <= 2, budgets


def test_the_total_stops_near_the_ridge():
    """Flat cost up to the ridge, then steep: the verified tokens (rows + nodes) end at the ridge."""
    rows, nodes, ridge = 8, 16, 64
    gen = torch.Generator().manual_seed(0)
    first = torch.rand(rows, 1, generator=gen) * 0.5 + 0.5
    decay = torch.rand(rows, 1, generator=gen) * 0.3 + 0.6
    weights = (first * decay ** torch.arange(nodes)).log()  # [B, M] descending
    cost = ridge_cost(rows * (nodes + 1), ridge=ridge, slope=0.2)
    budgets = allot(weights, [nodes] * rows, cost)
    assert abs(rows + sum(budgets) - ridge) <= 2, (rows + sum(budgets), budgets)
    # the chosen budgets beat every nearby total and a uniform split of the same total
    best = ratio(weights, budgets, cost, rows)
    uniform = [(ridge - rows) // rows] * rows
    assert best >= ratio(weights, uniform, cost, rows)


def test_tiny_probabilities_give_zero_budgets():
    weights = log_probs([[1e-4, 1e-5, 1e-6]] * 3)
    cost = ridge_cost(12, ridge=0, slope=0.02)  # every token costs a little
    assert allot(weights, [3] * 3, cost) == [0, 0, 0]
    assert allot(weights, [3] * 3, cost, padded=True) == [0, 0, 0]


def test_a_flat_cost_keeps_every_node_a_row_may_have():
    weights = log_probs([[0.5, 0.2, 0.1, 0.05], [0.5, 0.2], [0.9, 0.8, 0.7, 0.6]], width=4)
    flat = torch.ones(3 * 5 + 1)
    assert allot(weights, [4, 4, 2], flat) == [4, 2, 2]  # caps and missing nodes bound it
    assert allot(weights, [0, 4, 4], flat) == [0, 2, 4]


def test_ragged_allotment_is_optimal():
    """Brute force over every budget vector of small rounds: the allotment's objective is the best.
    (For a given total the best nodes are the most probable ones, so the best prefix of the greedy
    order is optimal for any cost curve; ridge-shaped and random ones here.)"""
    gen = torch.Generator().manual_seed(1)
    for case in range(40):
        rows, nodes = 3, 3
        weights = torch.sort(torch.rand(rows, nodes, generator=gen) ** 2, dim=1, descending=True).values.log()
        ridge, slope = int(torch.randint(0, 10, (1,), generator=gen)), float(torch.rand(1, generator=gen)) * 0.3
        cost = ridge_cost(rows * (nodes + 1), ridge=ridge, slope=slope)
        if case % 2:
            cost = torch.rand(rows * (nodes + 1) + 1, generator=gen) + 0.5
        got = allot(weights, [nodes] * rows, cost)
        best = max(ratio(weights, list(b), cost, rows) for b in itertools.product(range(nodes + 1), repeat=rows))
        assert ratio(weights, got, cost, rows) == pytest.approx(best, rel=1e-6), (case, got)


def test_a_step_in_the_cost_is_crossed_when_free_nodes_follow():
    """A bucketed cost (steps): the best total lies past a step that one more node alone does not pay
    for; stopping at the first node that does not improve the ratio would miss it."""
    weights = log_probs([[0.6] * 8] * 2)
    cost = torch.tensor([1.0] * 5 + [1.5] * 14)  # up to 4 tokens: 1.0; 5..18 tokens: 1.5
    budgets = allot(weights, [8, 8], cost)
    assert sum(budgets) == 16, budgets  # 2 + 16 tokens for 1.5 beats 2 + 2 for 1.0


def test_pad_rows_get_nothing_and_count_no_tokens():
    weights = log_probs([[0.9, 0.8], [0.9, 0.8], [0.9, 0.8]])
    cost = ridge_cost(9, ridge=0, slope=0.01)
    assert allot(weights, [2, 2, 2], cost, live=[True, False, True]) == [2, 0, 2]
    assert allot(weights, [2, 2, 2], cost, live=[True, False, True], padded=True) == [2, 0, 2]


def test_the_cost_curve_caps_the_round():
    """Tokens past the curve's end are not allowed: the total stays within it."""
    weights = log_probs([[0.9] * 6] * 2)
    budgets = allot(weights, [6, 6], torch.ones(7))  # at most 6 tokens: 2 roots + 4 nodes
    assert sum(budgets) == 4 and max(budgets) - min(budgets) <= 1, budgets
    assert allot(weights, [6, 6], torch.tensor([1.0, 1.0, 1.0, math.inf, math.inf])) == [0, 0]
    assert allot(weights, [6, 6], torch.tensor([1.0, 1.0, 1.0, math.inf, 1.0])) == [1, 1]  # (skips 3 tokens)


def test_padded_layout_gives_every_row_the_best_width():
    """Nodes under the widest row cost nothing more: every row takes min(cap, best width - 1)."""
    weights = log_probs([[0.95, 0.9, 0.85, 0.8], [0.2, 0.1, 0.05, 0.01], [0.5, 0.3, 0.2, 0.1]])
    rows = 3
    width_cost = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.8, 5: 2.4}  # per width; steep after 3
    cost = torch.tensor(cost_curve({rows * w: c for w, c in width_cost.items()}, rows * 5))
    budgets = allot(weights, [4, 4, 1], cost, padded=True)
    assert budgets == [2, 2, 1], budgets
    gains = weights.exp()
    for width in range(1, 6):  # the chosen width (3) is the best of all
        gain = sum(gains[b, :min(cap, width - 1)].sum().item() for b, cap in enumerate([4, 4, 1]))
        assert (rows + gain) / width_cost[width] <= (rows + sum(gains[b, :n].sum().item()
                                                                 for b, n in enumerate(budgets))) / width_cost[3] + 1e-6


def test_allotment_runs_without_host_syncs_on_the_inputs_device():
    weights = log_probs([[0.9, 0.5], [0.4, 0.1]])
    out = allot_budgets(weights, torch.tensor([2, 2]), torch.ones(7), torch.tensor([True, True]))
    assert out.dtype == torch.long and out.shape == (2,) and out.device == weights.device


def test_shapes_are_checked():
    caps, live = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="log_weights"):
        allot_budgets(torch.zeros(3), caps, torch.ones(4), live)
    with pytest.raises(ValueError, match="cost"):
        allot_budgets(torch.zeros(3, 2), caps, torch.ones(1, 4), live)


def test_cost_curve_interpolates_and_extends_flat():
    curve = cost_curve({2: 1.0, 6: 3.0}, 9)
    assert curve == pytest.approx([1.0, 1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0, 3.0, 3.0])
    assert cost_curve({4: 2.0}, 2) == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        cost_curve({}, 3)


def test_the_adaptive_policy_offers_its_cost_curve_by_verified_width():
    """Drafted rounds' times by the entries per row they verified, at rows x width tokens, linear in
    between and flat past the widest; the plain round's time is the floor of the narrowest; none for
    plain rounds, fixed counts, or before anything was timed."""
    from flashtree.policy import AdaptivePolicy, FixedNodes

    policy = AdaptivePolicy((8, 4, 0))
    assert policy.round_costs(2, 8) is None  # nothing timed yet
    policy.record(2, 0, 0.010, None)  # a plain round: 10 ms
    assert policy.round_costs(2, 0) is None
    assert policy.round_costs(2, 8) == pytest.approx([0.010] * 19)  # plain only: flat
    policy.record_width(2, 5, 0.018)  # a drafted round, widest row 4 nodes: 18 ms at 10 tokens
    curve = policy.round_costs(2, 8)
    assert len(curve) == 2 * 9 + 1
    assert curve[2] == pytest.approx(0.010) and curve[10] == pytest.approx(0.018)
    assert curve[6] == pytest.approx(0.014) and curve[18] == pytest.approx(0.018)
    policy.record_width(2, 1, 0.016)  # a drafted round of roots only costs the drafter pass too
    assert policy.round_costs(2, 8)[2] == pytest.approx(0.016)
    assert policy.round_costs(3, 8) is None  # another rows bucket (4): nothing timed there
    assert FixedNodes(8).round_costs(2, 8) is None


def test_a_packed_round_is_costed_by_its_total_not_its_widest_row():
    from flashtree.engine.engine import verified_width

    assert verified_width([3, 0, 1], packed=False) == 4  # the widest tree and its root
    assert verified_width([3, 0, 1], packed=True) == 3  # 7 entries over 3 rows, rounded up
    assert verified_width([2, 2], packed=True) == 3
