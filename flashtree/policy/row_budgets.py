"""Per-row node budgets: how many of its best drafted nodes each row of a round verifies.

A DDTree holds the prefixes of highest path probability ``p = exp(w)`` under the drafter's
factorized distribution, and (if the drafter's marginals are right) a node is accepted with its path
probability. A row that verifies its best ``b`` nodes therefore expects ``sum_{k < b} p_k`` accepted
drafted tokens, plus its bonus token, and the k-th node's marginal gain is ``p_k`` (``p`` descends).
A round's cost depends on the tokens it verifies. :func:`allot_budgets` picks the budgets that give
the most expected tokens per unit of cost,

    (live rows + sum of the verified nodes' p) / cost(verified tokens)

for one of two layouts of the verify forward:
- ragged: the rows' tokens packed into one flat batch, ``live rows + sum(budgets)`` tokens. Nodes
  join in one order across rows, by path probability (ties: shallower rank first, then lower row),
  and the round takes the prefix of that order with the best ratio: the greedy "add the next-best
  node while it pays", also past a step in the cost curve where a stretch of free nodes follows.
  For a given total the most probable nodes gain the most, so this is optimal for any cost curve.
- padded: every row verifies ``width = max budget + 1`` entries, ``live rows x width`` tokens; nodes
  under the widest row cost nothing more, so every row takes ``min(cap, width - 1)`` and the round
  takes the width with the best ratio.

Glossary: B rows, M ranked nodes per row, T the largest verified token count the cost curve allows.
Pure device work (no host sync), so it runs inside a round.
"""

from __future__ import annotations

from typing import Mapping

import torch


def allot_budgets(log_weights: torch.Tensor, caps: torch.Tensor, cost: torch.Tensor, live: torch.Tensor,
                  padded: bool = False) -> torch.Tensor:
    """Each row's node budget ``[B]`` (int64, ``0 <= budget <= caps``; 0 = a plain step for the row).

    log_weights: [B, M] each row's best path log-weights, descending (-inf: no such node).
    caps: [B] int64, the most nodes a row may verify (a request's own budget, the round's size).
    cost: [T + 1] float, > 0: the cost of a round verifying t tokens (inf: a round that large is not
    allowed); tokens past T are not allowed either.
    live: [B] bool, the real rows (pad rows get 0 nodes and count no tokens).
    padded: the padded layout (see the module docstring); default ragged.
    """
    if log_weights.dim() != 2 or caps.shape != log_weights.shape[:1] or live.shape != caps.shape:
        raise ValueError(f"log_weights must be [B, M] with caps and live [B], got {tuple(log_weights.shape)}, "
                         f"{tuple(caps.shape)}, {tuple(live.shape)}")
    if cost.dim() != 1 or cost.numel() == 0:
        raise ValueError(f"cost must be [T + 1] with T >= 0, got shape {tuple(cost.shape)}")
    rank = torch.arange(log_weights.shape[1], device=log_weights.device)  # [M]
    caps = torch.where(live, caps.clamp(min=0), 0)  # [B]
    usable = (rank[None, :] < caps[:, None]) & (log_weights > float("-inf"))  # [B, M]
    gains = torch.where(usable, log_weights.exp(), 0.0).float()  # [B, M] marginal gains p
    rows = live.sum()  # scalar tensor: each live row verifies (and keeps) its bonus token
    costs = torch.cat([cost.float(), cost.new_full((1,), float("inf")).float()])  # [T + 2]; T + 1 = not allowed
    if padded:
        return _padded(gains, usable, caps, costs, rows)
    return _ragged(gains, usable, costs, rows)


def _ragged(gains: torch.Tensor, usable: torch.Tensor, costs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The best prefix of the nodes ordered by gain across rows (see the module docstring)."""
    num_rows = gains.shape[0]
    by_rank = gains.T.reshape(-1)  # [M * B]; flat index k * B + b, so stable ties go rank first, then row
    key = torch.where(usable.T.reshape(-1), by_rank, -1.0)  # [M * B]; unusable nodes last
    order = torch.sort(key, descending=True, stable=True).indices  # [M * B]
    ordered_gain = torch.where(key[order] >= 0, by_rank[order], 0.0)  # [M * B]
    taken = torch.arange(ordered_gain.numel() + 1, device=gains.device)  # [M * B + 1] nodes taken
    gain = torch.cat([ordered_gain.new_zeros(1), ordered_gain.cumsum(0)])  # [M * B + 1]
    count_usable = usable.sum()
    tokens = (rows + taken).clamp(max=costs.numel() - 1)  # [M * B + 1]
    ratio = (rows + gain) / costs[tokens]  # [M * B + 1]
    ratio = torch.where(taken <= count_usable, ratio, -1.0)  # only usable nodes can be taken
    best = ratio.argmax()  # first of the best: the fewest nodes among equals
    chosen = torch.arange(order.numel(), device=gains.device) < best  # [M * B] in order
    budgets = torch.zeros(num_rows, dtype=torch.long, device=gains.device)
    return budgets.scatter_add_(0, order % num_rows, chosen.long())  # [B]; a prefix of each row's ranks


def _padded(gains: torch.Tensor, usable: torch.Tensor, caps: torch.Tensor, costs: torch.Tensor,
            rows: torch.Tensor) -> torch.Tensor:
    """The best width for every row at once (see the module docstring)."""
    ranked = gains.shape[1]
    gain = torch.cat([gains.new_zeros(1), gains.sum(0).cumsum(0)])  # [M + 1]; nodes below each width
    widths = torch.arange(1, ranked + 2, device=gains.device)  # [M + 1] entries per row
    tokens = (rows * widths).clamp(max=costs.numel() - 1)  # [M + 1]
    ratio = (rows + gain) / costs[tokens]  # [M + 1]
    best = ratio.argmax()  # first of the best: the narrowest among equals
    return torch.minimum(caps, torch.minimum(usable.sum(1), best))  # [B]


def cost_curve(points: Mapping[int, float], max_tokens: int) -> list[float]:
    """A round's cost for every verified token count ``0..max_tokens`` from measured ``points``
    (tokens -> cost): linear between them, flat before the first and after the last (a count
    past every measurement is assumed no dearer than the largest measured, so the allotment tries
    it and the next measurement corrects it)."""
    if not points:
        raise ValueError("cost_curve needs at least one measured point")
    known = sorted(points.items())
    curve, index = [], 0
    for tokens in range(max_tokens + 1):
        while index + 1 < len(known) and known[index + 1][0] <= tokens:
            index += 1
        (t0, c0), after = known[index], known[index + 1] if index + 1 < len(known) else None
        if tokens <= t0 or after is None:
            curve.append(c0)
        else:
            t1, c1 = after
            curve.append(c0 + (c1 - c0) * (tokens - t0) / (t1 - t0))
    return curve
