"""What the adaptive policy knows: running estimates of each option's acceptance and round time.

The policy scores an option by the tokens it expects per second per row,

    score(bucket, nodes) = acceptance(nodes) / seconds(bucket, nodes)

- acceptance(nodes): an exponential moving average (EMA) of the mean acceptance length of rounds
  with that node count, bonus included, shared by every rows bucket (it hardly depends on the
  batch). Plain rounds accept exactly 1. Each row of a round counts as one sample
  (``acceptance_smoothing`` per row): a single row's acceptance is a small integer that scatters
  widely, while a batch's mean is steadier and may move the estimate faster.
- seconds(bucket, nodes): an EMA of the round's host wall time per rows bucket. A sample is
  clipped to ``OUTLIER_FACTOR`` times the estimate first, so one stalled round barely moves it
  while a lasting change gets through in a few rounds.
- Monotone round times: a round that verifies more nodes never costs less, so a score uses the
  largest round-time estimate among its option and the smaller options timed in the bucket. A
  slow stretch that lifts plain's estimate then lifts every tree's with it, and a drafter that
  never matches can never make a tree look better than plain rounds.
- Bound: an option not yet timed in a bucket can score at most its acceptance (known from other
  buckets) over the round time of the largest smaller option timed there.
- Common pace: a timed round of a bucket's best option (an ordinary round, not a probe) scales the
  other options' round-time estimates of the bucket by the change of its own. Slowness of the
  machine hits every option alike; what the choice depends on is their relative cost, which
  probes and exploration measure.

- Learned start: a policy may start from what an earlier process learned (``learned.py``): each
  option's acceptance, and per rows bucket each drafted option's round time relative to a plain
  round's. The relative times wait for the bucket's first timed plain round, which scales them to
  this process's pace; an option so started counts its earlier timed rounds (up to the EMA's
  horizon), so it is explored no more than it would be in the earlier process.

Scores are recomputed only after a new measurement (a round asks for them several times, and a
round's host time is time the device may wait).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from flashtree.config import PolicyConfig
from flashtree.policy.base import PLAIN_ACCEPTANCE, PLAIN_NODES, round_fits

OUTLIER_FACTOR = 2.0  # round-time samples are clipped to this multiple of the current estimate
DOMINATED = 0.5  # exploration skips options measured (or bounded) below this fraction of the best score


class Ema:
    """An exponential moving average whose first ``1 / smoothing`` samples are a plain mean
    (so a first outlier does not linger); ``clip`` bounds a sample to that multiple of the
    current value."""

    __slots__ = ("value", "count", "smoothing", "clip")

    def __init__(self, smoothing: float, clip: float | None = None):
        self.value, self.count, self.smoothing, self.clip = 0.0, 0, smoothing, clip

    @classmethod
    def started(cls, smoothing: float, clip: float | None, value: float, count: int) -> Ema:
        """An average that continues from ``value`` over ``count`` samples (capped at ``1 / smoothing``:
        past it, an EMA weighs a new sample the same whatever came before)."""
        ema = cls(smoothing, clip)
        ema.value, ema.count = value, max(1, min(count, math.ceil(1.0 / smoothing)))
        return ema

    def add(self, sample: float, least_weight: float = 0.0) -> None:
        if self.clip is not None and self.count:
            sample = min(sample, self.clip * self.value)
        self.count += 1
        weight = max(self.smoothing, 1.0 / self.count, least_weight)
        self.value += weight * (sample - self.value)


class BucketEstimates(NamedTuple):
    """What a rows bucket's estimates say, as of measurement number ``version``."""

    version: int
    scores: dict  # option -> tokens/s per row (None while unmeasured)
    best: int  # the option with the highest score (ties: fewer nodes)
    bounds: dict  # option -> upper bound on its score (see Estimates.bound)
    unexplored: list  # options still to explore (see Estimates.unexplored)


class Estimates:
    """The acceptance and round-time EMAs of every option of ``ladder``, per rows bucket."""

    def __init__(self, ladder: Sequence[int], config: PolicyConfig):
        self.ladder, self.config = tuple(ladder), config
        self._acceptance: dict[int, Ema] = {}  # nodes -> mean acceptance length
        self._seconds: dict[tuple[int, int], Ema] = {}  # (rows bucket, nodes) -> round seconds
        self._timed_at: dict[tuple[int, int], int] = {}  # (rows bucket, nodes) -> the bucket's round count
        # when that option was last timed
        self._width_seconds: dict[int, dict[int, Ema]] = {}  # rows bucket -> verified width -> drafted round seconds
        self._started_ratios: dict[int, dict[int, tuple[float, int]]] = {}  # rows bucket -> nodes -> (round
        # time relative to plain's, timed rounds): learned earlier, applied at the bucket's first timed plain round
        self.version = 0  # measurements fed so far (the score cache's version)
        self._cache: dict[int, BucketEstimates] = {}  # rows bucket -> its estimates, as last computed

    # ------------------------------------------------------------------ reading
    def acceptance(self, nodes: int) -> float | None:
        """Mean acceptance length estimate (bonus included); exactly 1 for plain rounds."""
        if nodes == PLAIN_NODES:
            return PLAIN_ACCEPTANCE
        ema = self._acceptance.get(nodes)
        return ema.value if ema is not None else None

    def seconds(self, bucket: int, nodes: int) -> float | None:
        ema = self._seconds.get((bucket, nodes))
        return ema.value if ema is not None else None

    def timed(self, bucket: int, nodes: int) -> int:
        """Timed rounds of an option so far."""
        ema = self._seconds.get((bucket, nodes))
        return ema.count if ema is not None else 0

    def timed_at(self, bucket: int, nodes: int) -> int:
        """The bucket's round count when the option was last timed (-1: never)."""
        return self._timed_at.get((bucket, nodes), -1)

    def of(self, bucket: int) -> BucketEstimates:
        """The bucket's scores, best option, bounds and options still to explore, recomputed only
        after a measurement."""
        cached = self._cache.get(bucket)
        if cached is not None and cached.version == self.version:
            return cached
        scores, bounds = self._scores_and_bounds(bucket)
        known = [(score, -n) for n, score in scores.items() if score is not None and self.allowed(bucket, n)]
        best = -max(known)[1] if known else self.ladder[-1]
        cached = BucketEstimates(self.version, scores, best, bounds, [])
        cached.unexplored.extend(self._options_to_explore(bucket, cached))
        self._cache[bucket] = cached
        return cached

    def current(self, bucket: int) -> BucketEstimates | None:
        """The bucket's estimates as last computed, if no measurement came since (else None)."""
        cached = self._cache.get(bucket)
        return cached if cached is not None and cached.version == self.version else None

    def best(self, bucket: int) -> int:
        return self.of(bucket).best

    def allowed(self, bucket: int, nodes: int) -> bool:
        """``nodes`` may run in ``bucket``: plain, or a round of at most ``max_round_tokens`` tokens."""
        return round_fits(bucket, nodes, self.config.max_round_tokens)

    def score(self, bucket: int, nodes: int) -> float | None:
        """Tokens/s per row of the option, None while unmeasured (see "Monotone round times")."""
        return self.of(bucket).scores.get(nodes)

    def bound(self, bucket: int, nodes: int) -> float:
        """An upper bound on the score of an option not yet timed in ``bucket``: its acceptance over
        the round time of the largest smaller option timed here; infinite without both."""
        return self.of(bucket).bounds[nodes]

    def unexplored(self, bucket: int) -> list[int]:
        """Options with fewer than ``explore_rounds`` timed rounds that are not clearly worse than
        the best, measured or bounded; an option not yet timed must also be able to beat plain."""
        return self.of(bucket).unexplored

    def snapshot(self, bucket: int) -> list[list]:
        """Per ladder option: [nodes, acceptance, ms, timed rounds]."""
        options = []
        for n in self.ladder:
            seconds, acceptance = self.seconds(bucket, n), self.acceptance(n)
            options.append([n, None if acceptance is None else round(acceptance, 4),
                            None if seconds is None else round(seconds * 1000, 4), self.timed(bucket, n)])
        return options

    def _scores_and_bounds(self, bucket: int) -> tuple[dict[int, float | None], dict[int, float]]:
        """Every option's score and bound, in one pass up the ladder."""
        per_row, bounds = {}, {}
        slowest = 0.0  # the largest round-time estimate of the options so far timed in the bucket
        largest_smaller = None  # the round-time estimate of the largest option so far timed
        for n in reversed(self.ladder):  # fewest nodes first
            acceptance = self.acceptance(n)
            bounds[n] = float("inf") if acceptance is None or largest_smaller is None else \
                acceptance / max(largest_smaller, 1e-9)
            ema = self._seconds.get((bucket, n))
            if ema is not None:
                slowest = max(slowest, ema.value)
                largest_smaller = ema.value
            per_row[n] = None if acceptance is None or ema is None else acceptance / max(slowest, 1e-9)
        return {n: per_row[n] for n in self.ladder}, bounds

    def _options_to_explore(self, bucket: int, estimates: BucketEstimates) -> list[int]:
        scores = estimates.scores
        top = max((s for s in scores.values() if s is not None), default=0.0)
        plain = scores.get(PLAIN_NODES)

        def worth_trying(n: int) -> bool:
            if scores[n] is not None:
                return scores[n] >= DOMINATED * top
            bound = estimates.bounds[n]
            return bound >= DOMINATED * top and (plain is None or bound > plain)

        return [n for n in self.ladder
                if self.allowed(bucket, n) and self.timed(bucket, n) < self.config.explore_rounds and worth_trying(n)]

    def width_seconds(self, bucket: int) -> dict[int, float]:
        """Drafted rounds' seconds by the entries per row they verified (the widest row's tree plus
        its root), as measured in ``bucket``: the cost curve of the per-row allotment."""
        return {width: ema.value for width, ema in self._width_seconds.get(bucket, {}).items()}

    def learned_acceptance(self) -> dict[int, tuple[float, int]]:
        """Drafted options' acceptance: nodes -> (mean, samples)."""
        return {n: (ema.value, ema.count) for n, ema in self._acceptance.items()}

    def learned_ratios(self) -> dict[int, dict[int, tuple[float, int]]]:
        """Per rows bucket, drafted options' round time over plain's: nodes -> (ratio, the option's
        timed rounds); a bucket this process has not timed plain rounds in keeps what it started from."""
        ratios = {bucket: dict(started) for bucket, started in self._started_ratios.items()}
        for (bucket, nodes), ema in self._seconds.items():
            plain = self._seconds.get((bucket, PLAIN_NODES))
            if nodes != PLAIN_NODES and plain is not None and plain.value > 0.0:
                ratios.setdefault(bucket, {})[nodes] = (ema.value / plain.value, ema.count)
        return {bucket: by_nodes for bucket, by_nodes in ratios.items() if by_nodes}

    # ------------------------------------------------------------------ feeding
    def start_from(self, acceptance: dict[int, tuple[float, int]],
                   ratios: dict[int, dict[int, tuple[float, int]]]) -> None:
        """Start from learned estimates (see "Learned start"); options off the ladder are ignored."""
        self.version += 1
        for nodes, (mean, samples) in acceptance.items():
            if nodes in self.ladder and nodes != PLAIN_NODES:
                self._acceptance[nodes] = Ema.started(self.config.acceptance_smoothing, None, mean, samples)
        for bucket, by_nodes in ratios.items():
            kept = {n: pair for n, pair in by_nodes.items() if n in self.ladder and n != PLAIN_NODES}
            if kept:
                self._started_ratios[bucket] = kept

    def _apply_started_ratios(self, bucket: int, round_index: int) -> None:
        """The bucket's first timed plain round: its learned relative round times, at this pace."""
        plain = self._seconds[(bucket, PLAIN_NODES)].value
        for nodes, (ratio, timed) in self._started_ratios.pop(bucket).items():
            if (bucket, nodes) not in self._seconds:
                self._seconds[(bucket, nodes)] = Ema.started(self.config.smoothing, OUTLIER_FACTOR, ratio * plain,
                                                             timed)
                self._timed_at[(bucket, nodes)] = round_index

    def measure_width(self, bucket: int, width: int, seconds: float) -> None:
        """A drafted round of ``bucket`` that verified ``width`` entries per row took ``seconds``."""
        by_width = self._width_seconds.setdefault(bucket, {})
        ema = by_width.get(width)
        if ema is None:
            ema = by_width[width] = Ema(self.config.smoothing, OUTLIER_FACTOR)
        ema.add(seconds)

    def measure(self, bucket: int, nodes: int, seconds: float | None, acceptance: float | None, weight: float,
                rows: int, pace: bool, round_index: int) -> None:
        """Feed one measurement (``weight``: the least EMA weight it gets; ``rows``: rows whose mean
        acceptance it is; ``round_index``: the bucket's round count now). ``pace``: a round of the
        bucket's best option, whose change of estimate every other option's follows."""
        self.version += 1
        if seconds is not None:
            ema = self._seconds.get((bucket, nodes))
            if ema is None:
                ema = self._seconds[(bucket, nodes)] = Ema(self.config.smoothing, OUTLIER_FACTOR)
            before = ema.value
            ema.add(seconds, weight)
            if pace and before > 0.0:
                self._follow_pace(bucket, nodes, ema.value / before)
            self._timed_at[(bucket, nodes)] = round_index
            if nodes == PLAIN_NODES and bucket in self._started_ratios:
                self._apply_started_ratios(bucket, round_index)
        if acceptance is not None and nodes != PLAIN_NODES:
            per_rows = 1.0 - (1.0 - self.config.acceptance_smoothing) ** rows  # each row one sample
            self._acceptance.setdefault(nodes, Ema(self.config.acceptance_smoothing)).add(
                acceptance, max(weight, per_rows))

    def _follow_pace(self, bucket: int, paced_by: int, ratio: float) -> None:
        """Scale the round-time estimates of ``bucket``'s options other than ``paced_by`` by ``ratio``."""
        for nodes in self.ladder:
            ema = self._seconds.get((bucket, nodes))
            if ema is not None and nodes != paced_by:
                ema.value *= ratio
