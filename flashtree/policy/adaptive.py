"""The adaptive speculation policy: each round's node count, chosen for the most tokens per second.

A round that verifies ``nodes`` drafted nodes per row costs more than a plain step and pays off
only when enough of them are accepted. The best count depends on the drafter (acceptance), on the
batch (a round's cost grows with rows x nodes once the device is busy) and on the device.
:class:`AdaptivePolicy` picks it from a ladder by the scores of :mod:`estimates`, fed by the engine
after every round (:meth:`AdaptivePolicy.record`).

- Exploration: every option of a bucket is tried ``explore_rounds`` times first (round robin,
  fewest measurements first, smaller trees first), except an option clearly worse than the best
  (its score, or its bound, under ``DOMINATED`` of the best), and an option not yet timed whose
  bound cannot beat plain rounds: a drafter that never matches explores trees in its first bucket
  only (each new option at a new shape captures a CUDA graph, which costs many rounds).
- Neighbour probes: every ``probe_interval`` rounds of a bucket, a ladder neighbour of the best
  option runs for ``probe_rounds`` rows' worth of rounds (at least one round), averaged into one
  measurement of weight ``PROBE_WEIGHT``; it is the neighbour timed longer ago (alternately when
  tied), so drift in acceptance or cost moves the choice. A probe that finds its option clearly
  worse (under ``BACKOFF_BELOW``) doubles the interval up to ``max_probe_interval``; one far worse
  (under ``DOMINATED``) sets it there at once; either also stretches it until such probes cost at
  most ``probe_cost_share`` of the bucket's time. A probe that changes the best option resets it.
- Rechecks: when an ordinary round's measurement changes the best option, the displaced option is
  probed again at the next round; if that confirms the change, the next probe re-measures it once
  more. A few unlucky rounds then cost one probe, not ``probe_interval`` rounds of a worse option.
- Plain rechecks: while a tree is best, plain rounds are re-measured whenever they have gone
  ``plain_recheck_interval`` rounds of the bucket unmeasured: plain is the fallback, so its
  estimate must not go stale.
- Settled rounds: a round of the best option of an explored bucket, with no probe in progress or
  due, changes nothing but the estimates. Such measurements are held and folded ``settled_batch`` at
  a time (in order, the same EMA updates), earlier when anything else is about to happen; an engine
  whose device runs ahead of the host folds them while the next round runs (:meth:`fold_settled`).
- Round size: in a bucket, options whose rounds would verify more than ``max_round_tokens`` tokens
  (bucket rows x (nodes + 1)) are never explored, probed or chosen (on a CPU: trees past its ridge).
- Declined probes: the engine may decline a neighbour probe whose round would capture a CUDA graph
  for an option that cannot beat the best one (:meth:`worth_a_graph`); the next probe then waits
  twice as long.

- Per-row budgets: a drafted round's option is the most nodes a row may verify; each row then keeps
  the best of its own tree's nodes for the most expected tokens per second (``row_budgets.py``), by
  the round's cost curve over verified tokens (:meth:`AdaptivePolicy.round_costs`: drafted rounds'
  times by the entries per row they verified, linear in between, flat past the widest; the plain
  round's time is the floor of the narrowest). Whether to draft at all stays the option's choice:
  the drafter runs before any tree exists.

- Learned start: :meth:`AdaptivePolicy.start_from` takes what an earlier process learned
  (``learned.py``; ``memory.py`` keeps it on disk): acceptance and relative round times (see
  ``estimates``), and each bucket's probe schedule, so that a fresh process neither explores again
  nor probes sooner than the earlier one would have, except that its first probe comes within
  ``max_probe_interval`` rounds (past the cost floor's longer wait): a new process may bring new
  kinds of prompts, and a run of short processes then still probes every ``max_probe_interval``
  rounds. And while a tree is best, plain rounds are rechecked at round ``probe_interval`` already:
  the learned times are relative to plain's, which a process times only in its first (cold) rounds
  before then; a short process would otherwise never re-time plain (``plain_recheck_interval``), and
  a skewed ratio, once kept, would hold every later process on trees. :meth:`AdaptivePolicy.learned`
  gives it back.

Everything is deterministic given the same measurements.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Sequence

from flashtree.config import PolicyConfig
from flashtree.policy.base import PLAIN_NODES, rows_bucket, widest_fitting
from flashtree.policy.estimates import DOMINATED, Estimates
from flashtree.policy.learned import Learned, LearnedBucket
from flashtree.policy.row_budgets import cost_curve

BACKOFF_BELOW = 0.8  # a probe below this fraction of the best score doubles the probe interval
PROBE_WEIGHT = 0.75  # EMA weight of a probe's measurements (at least; the estimate it refreshes is old)
# what a probe is (see "Rechecks" and "Plain rechecks" above)
NEIGHBOUR_PROBE = 0  # a regular probe of a ladder neighbour of the best option
RECHECK_NOW = 1  # the immediate recheck of the option an ordinary round displaced
RECHECK_LATER = 2  # the next probe's recheck of it, after the immediate one confirmed the change
PLAIN_RECHECK = 3  # plain rounds, re-measured while a tree is chosen


@dataclasses.dataclass
class _Probe:
    """A probe in progress: its option, bucket, the best option when it began, the rounds it still
    takes after the current one, and the measurements of its rounds so far."""

    nodes: int
    bucket: int
    best_before: int
    rounds_left: int
    recheck: int = NEIGHBOUR_PROBE  # or RECHECK_NOW, RECHECK_LATER, PLAIN_RECHECK
    seconds: list[float] = dataclasses.field(default_factory=list)
    acceptance: list[float] = dataclasses.field(default_factory=list)


class AdaptivePolicy:
    """Picks each round's node count from ``ladder`` (see the module docstring)."""

    def __init__(self, ladder: Sequence[int], config: PolicyConfig = PolicyConfig()):
        if not ladder or len(set(ladder)) != len(ladder) or min(ladder) < 0:
            raise ValueError(f"ladder must be distinct node counts >= 0, got {tuple(ladder)}")
        self.ladder = tuple(sorted(ladder, reverse=True))
        self.config = config
        self.estimates = Estimates(self.ladder, config)
        self._rounds: Counter[int] = Counter()  # rows bucket -> rounds chosen for it
        self._interval: dict[int, int] = {}  # rows bucket -> rounds between probes (backs off)
        self._next_probe: dict[int, int] = {}  # rows bucket -> round count at which to probe
        self._probes: Counter[int] = Counter()  # rows bucket -> probes so far (alternates up / down)
        self._probe: _Probe | None = None  # the probe in progress
        self._recheck: dict[int, tuple[int, int]] = {}  # rows bucket -> (displaced option the next probe
        # re-measures, RECHECK_NOW or RECHECK_LATER)
        self._plain_timed_at: dict[int, int] = {}  # rows bucket -> its round count when plain was last timed
        self._settled: list[tuple] = []  # held settled rounds: (rows, nodes, seconds, acceptance), one bucket
        self._settled_bucket = 0  # the bucket of the held rounds
        self._started_from: Learned | None = None  # what an earlier process learned (start_from)
        self._started_plain_recheck: dict[int, int] = {}  # rows bucket -> round count of its first plain
        # recheck, for buckets started from learned relative times (see "Learned start")

    # ------------------------------------------------------------------ learned across processes
    def start_from(self, learned: Learned) -> None:
        """Continue from what an earlier process learned (see "Learned start"); call before the first round."""
        if self._rounds:
            raise RuntimeError("start_from() must come before the policy's first round")
        self._started_from = learned
        self.estimates.start_from(learned.acceptance,
                                  {b: data.relative_seconds for b, data in learned.buckets.items()})
        for bucket, data in learned.buckets.items():
            if data.relative_seconds:
                self._started_plain_recheck[bucket] = self.config.probe_interval
            if data.probe_interval is not None and data.rounds_to_probe is not None:
                self._interval[bucket] = data.probe_interval
                self._next_probe[bucket] = min(data.rounds_to_probe, self.config.max_probe_interval)

    @property
    def rounds_chosen(self) -> int:
        """Rounds chosen so far, every bucket together."""
        return sum(self._rounds.values())

    def learned(self) -> Learned:
        """What this policy knows now, to start another process from (buckets it did not run keep
        what it started from)."""
        started = self._started_from.buckets if self._started_from is not None else {}
        buckets = {}
        for bucket, ratios in self.estimates.learned_ratios().items():
            if bucket in self._next_probe:
                interval = self._interval.get(bucket, self.config.probe_interval)
                rounds_to_probe = max(0, self._next_probe[bucket] - self._rounds[bucket])
            elif bucket in started:
                interval, rounds_to_probe = started[bucket].probe_interval, started[bucket].rounds_to_probe
            else:
                interval = rounds_to_probe = None
            buckets[bucket] = LearnedBucket(ratios, interval, rounds_to_probe)
        return Learned(self.estimates.learned_acceptance(), buckets)

    # ------------------------------------------------------------------ decisions
    def choose(self, rows: int) -> int:
        """The node count of the next round of ``rows`` rows."""
        bucket = rows_bucket(rows)
        if self._settled:
            if bucket == self._settled_bucket and not self._decision_due(bucket):
                self._rounds[bucket] += 1
                return self._settled[-1][1]  # settled: the held rounds' option, the best one
            self._fold_held()
        self._rounds[bucket] += 1
        probe = self._probe
        if probe is not None:
            if probe.bucket == bucket and probe.rounds_left > 0:
                probe.rounds_left -= 1
                return probe.nodes
            self._finish_probe()  # done, or the batch moved to another bucket: use what it measured
        unexplored = self.estimates.unexplored(bucket)
        if unexplored:  # smaller first: it bounds the rest
            return min(unexplored, key=lambda n: (self.estimates.timed(bucket, n), n))
        best = self.best(rows)
        if self._plain_recheck_due(bucket, best, self._rounds[bucket]):
            self._plain_timed_at[bucket] = self._rounds[bucket]  # (also if its rounds go untimed: no retry each round)
            self._started_plain_recheck.pop(bucket, None)
            self._probe = _Probe(PLAIN_NODES, bucket, best, rounds_left=self._probe_rounds(rows) - 1,
                                 recheck=PLAIN_RECHECK)
            return PLAIN_NODES
        if self._rounds[bucket] >= self._next_probe.setdefault(bucket, self._rounds[bucket] + self.config.probe_interval):
            self._probes[bucket] += 1
            displaced, recheck = self._recheck.pop(bucket, (None, NEIGHBOUR_PROBE))
            if displaced in (None, best):
                larger = self._probe_larger(bucket, best)
                displaced, recheck = self._neighbour(bucket, best, larger), NEIGHBOUR_PROBE
            self._probe = _Probe(displaced, bucket, best, rounds_left=self._probe_rounds(rows) - 1, recheck=recheck)
            return displaced
        return best

    def best(self, rows: int) -> int:
        """The option with the highest estimated score (ties: fewer nodes); options without
        estimates are skipped (plain always has one once timed)."""
        return self.estimates.best(rows_bucket(rows))

    def settled_on_plain(self, rows: int) -> bool:
        """A plain round of ``rows`` rows is a settled one (no probe in progress, the bucket explored,
        plain its best option): the engine may choose the next round before recording this one."""
        return self._is_settled(rows_bucket(rows), PLAIN_NODES)

    @property
    def probing(self) -> bool:
        """The round just chosen belongs to a neighbour probe (not to exploration, the best option,
        a recheck or a plain recheck, whose timing is the point of them)."""
        return self._probe is not None and self._probe.recheck == NEIGHBOUR_PROBE

    def worth_a_graph(self, rows: int, nodes: int) -> bool:
        """Whether ``nodes`` could beat the best option of ``rows``' bucket: its bound is above the
        best option's score. A drafter that never matches makes no tree worth it."""
        bucket = rows_bucket(rows)
        estimates = self.estimates.of(bucket)
        top = estimates.scores.get(estimates.best)
        return top is None or self.estimates.bound(bucket, nodes) > top

    def decline_probe(self) -> None:
        """The engine did not run the neighbour probe just chosen: it ends unmeasured, and the next
        one waits twice as long (up to ``max_probe_interval``)."""
        probe, self._probe = self._probe, None
        if probe is None or probe.recheck != NEIGHBOUR_PROBE:
            raise RuntimeError("decline_probe() needs a neighbour probe in progress (see probing)")
        interval = min(2 * self._interval.get(probe.bucket, self.config.probe_interval), self.config.max_probe_interval)
        self._interval[probe.bucket] = interval
        self._next_probe[probe.bucket] = self._rounds[probe.bucket] + interval

    def tokens_per_second(self, rows: int, nodes: int) -> float | None:
        """Expected throughput of a round of ``nodes`` nodes, None while unmeasured."""
        per_row = self.estimates.score(rows_bucket(rows), nodes)
        return None if per_row is None else rows * per_row

    def acceptance(self, nodes: int) -> float | None:
        return self.estimates.acceptance(nodes)

    def snapshot(self, rows: int) -> dict:
        """The estimates for ``rows``' bucket, per ladder option: [nodes, acceptance, ms, timed rounds]."""
        bucket = rows_bucket(rows)
        return {"options": self.estimates.snapshot(bucket), "next_probe": self._next_probe.get(bucket)}

    def widest_round(self, max_rows: int) -> tuple[int, int]:
        return widest_fitting(self.ladder, max_rows, self.estimates.allowed)

    def _decision_due(self, bucket: int) -> bool:
        """The next round of ``bucket`` starts a plain recheck or a neighbour probe."""
        rounds = self._rounds[bucket] + 1
        return (self._plain_recheck_due(bucket, self._settled[-1][1], rounds)
                or rounds >= self._next_probe.get(bucket, rounds + 1))

    def _plain_recheck_due(self, bucket: int, best: int, rounds: int) -> bool:
        """At round ``rounds`` of ``bucket``, with a tree as the ``best`` option, plain has gone
        ``plain_recheck_interval`` rounds unmeasured, or a started bucket's first recheck is due."""
        if best == PLAIN_NODES or PLAIN_NODES not in self.ladder:
            return False
        started = self._started_plain_recheck.get(bucket)
        return (started is not None and rounds >= started) or (
            rounds - self._plain_timed_at.get(bucket, 0) >= self.config.plain_recheck_interval)

    def _probe_rounds(self, rows: int) -> int:
        """Rounds of a probe at ``rows`` rows: enough for ``probe_rounds`` rows' worth of rounds."""
        return max(1, -(-self.config.probe_rounds // rows))

    def _probe_larger(self, bucket: int, best: int) -> bool:
        """Whether a neighbour probe tries the larger neighbour of ``best``: the one of the two timed
        longer ago (never: longest ago), alternately on a tie."""
        index = self.ladder.index(best)
        if index == 0 or index == len(self.ladder) - 1:
            return index != 0  # one neighbour only
        larger = self.estimates.timed_at(bucket, self.ladder[index - 1])
        smaller = self.estimates.timed_at(bucket, self.ladder[index + 1])
        return larger < smaller if larger != smaller else self._probes[bucket] % 2 == 1

    def _neighbour(self, bucket: int, nodes: int, larger: bool) -> int:
        """The ladder option next to ``nodes`` that ``bucket`` allows: the larger one if asked and there is one."""
        index = self.ladder.index(nodes)
        up = self.ladder[index - 1] if index > 0 and self.estimates.allowed(bucket, self.ladder[index - 1]) else None
        down = self.ladder[index + 1] if index + 1 < len(self.ladder) else None
        first, second = (up, down) if larger else (down, up)
        return first if first is not None else (second if second is not None else nodes)

    # ------------------------------------------------------------------ measurements
    def record(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None) -> None:
        """What a round of ``rows`` rows and ``nodes`` nodes measured: its host wall time (None:
        not representative, e.g. it captured a CUDA graph) and its rows' mean acceptance length
        (None: no row could use the full node count)."""
        if nodes not in self.ladder:
            raise ValueError(f"nodes {nodes} is not on the ladder {self.ladder}")
        bucket = rows_bucket(rows)
        probe = self._probe
        if probe is not None and probe.nodes == nodes and probe.bucket == bucket:
            if seconds is not None:
                probe.seconds.append(seconds)
            if acceptance is not None:
                probe.acceptance.append(acceptance)
            if probe.rounds_left == 0:
                self._finish_probe()
            return
        if self._is_settled(bucket, nodes):
            self._settled.append((rows, nodes, seconds, acceptance))
            self._settled_bucket = bucket
            if len(self._settled) >= self.config.settled_batch:
                self._fold_held()
            return
        self._fold_held()  # (measurements go in in order)
        best_before = self.best(rows) if not self.estimates.unexplored(bucket) else None
        self._measure(bucket, nodes, seconds, acceptance, weight=0.0, rows=rows, pace=nodes == best_before)
        self._check_best_moved(bucket, best_before)

    def fold_settled(self) -> None:
        """The held settled rounds into the estimates, in order; the best option is recomputed once."""
        self._fold_held()

    def round_costs(self, rows: int, nodes: int) -> list[float] | None:
        """A drafted round's cost by verified tokens (see "Per-row budgets"); None for a plain round,
        or before anything of ``rows``' bucket was timed."""
        if nodes == PLAIN_NODES:
            return None
        bucket = rows_bucket(rows)
        points = {rows * width: seconds for width, seconds in self.estimates.width_seconds(bucket).items()}
        plain = self.estimates.seconds(bucket, PLAIN_NODES)
        if plain is not None:
            points.setdefault(rows, plain)  # a width-1 drafted round without its drafter pass (a floor)
        return cost_curve(points, rows * (nodes + 1)) if points else None

    def record_width(self, rows: int, width: int, seconds: float) -> None:
        self.estimates.measure_width(rows_bucket(rows), width, seconds)

    def _is_settled(self, bucket: int, nodes: int) -> bool:
        """A round of ``nodes`` is a settled one: no probe in progress, ``bucket`` explored and
        ``nodes`` its best option (by the estimates as last computed), the held rounds' bucket."""
        if self.config.settled_batch == 1 or self._probe is not None:
            return False
        if self._settled and bucket != self._settled_bucket:
            return False
        current = self.estimates.current(bucket)
        return current is not None and not current.unexplored and current.best == nodes

    def _fold_held(self) -> None:
        if not self._settled:
            return
        held, self._settled = self._settled, []
        bucket = self._settled_bucket
        best_before = held[0][1]  # they were held because it was the best option
        for rows, nodes, seconds, acceptance in held:
            self._measure(bucket, nodes, seconds, acceptance, weight=0.0, rows=rows, pace=True)
        self._check_best_moved(bucket, best_before)

    def _check_best_moved(self, bucket: int, best_before: int | None) -> None:
        """An ordinary measurement moved the best option away from ``best_before`` (None: the bucket
        was still exploring): the displaced option is rechecked at the next round."""
        if best_before is not None and self.estimates.best(bucket) != best_before:
            self._recheck[bucket] = (best_before, RECHECK_NOW)
            self._interval[bucket] = self.config.probe_interval
            self._next_probe[bucket] = self._rounds[bucket]  # the next round

    def _measure(self, bucket: int, nodes: int, seconds: float | None, acceptance: float | None,
                 weight: float, rows: int = 1, pace: bool = False) -> None:
        if seconds is not None and nodes == PLAIN_NODES:
            self._plain_timed_at[bucket] = self._rounds[bucket]
        self.estimates.measure(bucket, nodes, seconds, acceptance, weight, rows, pace, self._rounds[bucket])

    def _finish_probe(self) -> None:
        """The probe's rounds, averaged, as one heavily weighted measurement; then the next probe
        is scheduled."""
        probe, self._probe = self._probe, None
        mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
        self._measure(probe.bucket, probe.nodes, mean(probe.seconds), mean(probe.acceptance), PROBE_WEIGHT)
        if probe.recheck == PLAIN_RECHECK and self.estimates.best(probe.bucket) == probe.best_before:
            return  # a plain recheck that changed nothing: the neighbour probes keep their schedule
        self._schedule_next_probe(probe.bucket, probe.nodes, probe.best_before, probe.recheck,
                                  probe_rounds=max(1, len(probe.seconds)))

    def _schedule_next_probe(self, bucket: int, probed: int, best_before: int, recheck: int = NEIGHBOUR_PROBE,
                             probe_rounds: int = 1) -> None:
        """Back off after a probe of a clearly worse option (at least to the interval that keeps
        such probes' cost under ``probe_cost_share``); probe again soon after one that changed the
        best option, or after an immediate recheck that confirmed a change (then the next probe
        rechecks the displaced option again); keep the interval otherwise."""
        interval = self._interval.get(bucket, self.config.probe_interval)
        best = self.estimates.best(bucket)
        probed_rate, best_rate = self.estimates.score(bucket, probed), self.estimates.score(bucket, best)
        if recheck == RECHECK_NOW and best == best_before:
            self._recheck[bucket] = (probed, RECHECK_LATER)
            interval = self.config.probe_interval
        elif best != best_before:
            interval = self.config.probe_interval
        elif probed_rate is not None and best_rate is not None and probed_rate < DOMINATED * best_rate:
            interval = max(self.config.max_probe_interval,  # it would take a 2x change to matter
                           self._interval_for_cost(bucket, probed, best, probe_rounds, probed_rate / best_rate))
        elif probed_rate is not None and best_rate is not None and probed_rate < BACKOFF_BELOW * best_rate:
            interval = max(min(2 * interval, self.config.max_probe_interval),
                           self._interval_for_cost(bucket, probed, best, probe_rounds, probed_rate / best_rate))
        self._interval[bucket] = interval
        self._next_probe[bucket] = self._rounds[bucket] + interval

    def _interval_for_cost(self, bucket: int, probed: int, best: int, probe_rounds: int, rate_ratio: float) -> int:
        """The fewest rounds of ``bucket`` between probes of ``probed`` that keep their cost within
        ``probe_cost_share`` of the bucket's time (0 without a share): a probe's ``probe_rounds``
        rounds lose ``rounds x seconds(probed) x (1 - rate_ratio)`` against ``interval x
        seconds(best)`` of the rounds in between."""
        share = self.config.probe_cost_share
        probed_seconds, best_seconds = self.estimates.seconds(bucket, probed), self.estimates.seconds(bucket, best)
        if share is None or probed_seconds is None or best_seconds is None:
            return 0
        lost = probe_rounds * probed_seconds * max(0.0, 1.0 - rate_ratio)
        return math.ceil(lost / (share * max(best_seconds, 1e-9)))
