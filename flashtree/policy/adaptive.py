"""Adaptive speculation: how many drafted nodes each round verifies (issue #5).

A round that verifies ``nodes`` drafted nodes per row costs more than a plain step, and pays
off only when enough of them are accepted. The best node count depends on the drafter (how
much it agrees with the target: acceptance), on the batch (a round's cost grows with rows x
nodes once the device is busy) and on the device. :class:`SpecPolicy` picks it per round from
a small ladder of node counts by maximizing the expected throughput

    tokens/s(rows, nodes) = rows x acceptance(nodes) / seconds(bucket(rows), nodes)

with online estimates the engine feeds it after every round (:meth:`SpecPolicy.record`):
- acceptance(nodes): an exponential moving average (EMA) of the mean acceptance length of
  rounds with that node count (bonus included; it hardly depends on the batch size, so it is
  shared by every rows bucket). The plain option (0 nodes) accepts exactly 1 token. Its EMA
  weighs each row of a round as one sample (``acceptance_smoothing`` per row: 0.05 for one row,
  0.34 for eight): one row's round accepts a small integer number of tokens that scatters widely
  around its mean, and a fast EMA of single rows wanders across the break-even point of a close
  choice, while a batch's mean is steadier and may move the estimate faster.
- seconds(bucket, nodes): an EMA of the round's measured host wall time, per rows bucket
  (1, 2, 4, 8, ...: the next power of two at or above the rows). A sample is clipped to
  ``OUTLIER_FACTOR`` times the estimate first, so one stalled round (another process, a page
  fault) barely moves it while a lasting change still gets through in a few rounds.

Exploration: every option of a bucket is tried ``explore_rounds`` times before the estimates
decide (round robin, fewest measurements first, smaller trees first), so an unseen bucket explores
on its own; an option already measured at under ``DOMINATED`` of the best estimate is not tried
again (big trees at a big batch can cost many plain steps), nor is one whose bound is: its
acceptance (known from other buckets) over the round time of the largest smaller option timed in
the bucket (a round that verifies more nodes never costs less), the most it can score. So a big
batch that finds its small trees clearly worse never pays a round of the big ones. An option not
yet timed in the bucket is also skipped when its bound does not beat plain rounds' score there:
a drafter that never matches (acceptance 1: no tree can beat plain rounds) explores trees in its
first bucket only. Exploring them in every new bucket cost a server 5-15% of a pass at 16 rows on
the H200: each first round of an option at a new shape captures a CUDA graph (0.1-0.3 s), and
exploration went on across passes (benchmarks/README.md, "Ninth session"). The neighbour probes
still try trees there now and then; the engine declines a probe whose round would capture a graph
for an option that cannot win (:meth:`SpecPolicy.worth_a_graph`, :meth:`SpecPolicy.decline_probe`:
the next probe then waits twice as long).
Tracking: after ``probe_interval`` rounds of a bucket, a neighbour of the best option in the
ladder is tried for ``probe_rounds`` rounds in a row (the one of the two timed longer ago: in a
settled bucket alternately the larger and the smaller; after the best option moved, first the side
the move did not come from, whose estimate is the staler; by parity alone, a climb back up from
plain after a drift down could probe plain first, find it far worse and wait ``max_probe_interval``
rounds), so drift in acceptance or cost moves the choice. The probe's rounds are averaged and go into the
estimates as one measurement of weight ``PROBE_WEIGHT`` (the old estimate is stale). One round
of one row is too few: a row's acceptance length is a small integer that scatters widely (a real
drafter's rounds accept 1 to 5 tokens around a mean of 2.5), so single-round probes that happened
to accept nothing could push a better option out for good (seen with SmolLM2 on the CPU). A round
of many rows already averages their acceptance, so a probe lasts ``probe_rounds`` rows' worth of
rounds: 4 rounds at one row, one round from 4 rows on (a tree round at 32 rows on a CPU cost 3.7
plain rounds; four of them per probe were most of what adaptive serving lost there).
A probe whose option stays clearly worse (under ``BACKOFF_BELOW`` of the best estimate)
doubles that bucket's interval (up to ``max_probe_interval``), one far worse (under ``DOMINATED``:
it would take a 2x change to matter, e.g. a tree at a big batch on a compute-bound CPU) sets it to
``max_probe_interval`` at once; one that changes the best option resets it: a settled choice
(e.g. plain rounds with a drafter that never matches) pays for few probes, a drifting one is
followed fast.
Probe cost: a probe that changes nothing costs its rounds' lost time (the same tokens would have
taken the best option less), and the doubling alone spends it every ``max_probe_interval`` rounds
at most: at one row on the H200 a drafter that never matches made that 0.2-0.3% of an engine's
time (4 rounds of a tree of 4 at +2.1-2.6 ms each every 800 plain rounds of 4.7 ms;
benchmarks/README.md, "Fifteenth session"). So a probe found clearly worse also sets the interval
to at least the one that keeps such probes within ``probe_cost_share`` of the bucket's time (0.1%:
about 1,800 rounds there, 8 s). A cheap one (many rows: one round of a tree that costs little more
than a plain round) gets a floor of a few hundred rounds, under ``max_probe_interval``, so the
doubling still ends there. The price: a drafter that starts to match is noticed that much later.
Common pace: only the chosen option gets measured between probes, so a run of slow rounds
(another process on the machine, another thread holding the interpreter, a burst of HTTP work in a
server) used to lift its estimate above an option timed long ago under quiet conditions, and
that stale estimate then won. A CPU server at 32 rows, whose tree rounds cost 4.4 plain rounds,
ran a dozen of them per pass that way (0.71-0.80 of plain's throughput in two passes of a paired
load test; benchmarks/README.md, "Sixteenth session"). Such slowness is the machine's, and hits
every option alike; what the choice depends on is the options' relative cost. So a timed round
of the bucket's best option (an ordinary or a settled round, not a probe or exploration) scales
every other option's round-time estimate in the bucket by the change of its own: ordinary rounds
set the bucket's pace, probes and exploration its relative costs. A change of one option's own
cost (plain rounds slower for good while trees are not) then shows at the next probe.
Rechecks: when an ordinary round's measurement changes the best option (its acceptance, now that
the common pace keeps the relative round times; before it, a run of slow rounds could too),
the option it displaced is probed again at once (the next round): a few unlucky rounds then cost
one probe of the option that was best, not ``probe_interval`` rounds of a worse one (seen on the
H200: a server with a drafter that never matched ran 73 drafted rounds in 3,048 before rechecks).
If that recheck confirms the change, the probe interval resets and the next probe re-measures
the displaced option once more (instead of a neighbour of the new best, which may not be it).
Plain rechecks: plain rounds are the fallback, so their estimate must not go stale. From a tree
in the middle of the ladder the neighbour probes reach plain only by way of the smallest tree, and
a high estimate of plain (left by a slow stretch before the common pace, seen on the H200: a
server idle between the passes of a paired load test; or plain rounds that became cheaper) could
then keep a drafter that never matches on trees for good.
So while the best option is a tree, plain is probed whenever it has gone ``plain_recheck_interval``
rounds of the bucket unmeasured; the probe interval is left alone unless the recheck moves the
best option.
Monotone round times: a round that verifies more nodes never costs less, so an option's score
uses the largest round-time estimate among it and the smaller options timed in the bucket. A
slow stretch that lifts plain's estimate then lifts every tree's with it, and a drafter that
never matches (acceptance 1) can never make a tree look better than plain rounds (seen on the
H200: a DDTree server at one row ran 150-190 rounds of a tree in every 1,524-round pass).
Settled rounds: a round of the best option in an explored bucket, with no probe in progress or
due, changes nothing but the estimates. Such rounds' measurements are held and folded in
``settled_batch`` at a time (in order, the same EMA updates), and the best option is recomputed
once per batch; a change of it then triggers the recheck as above, a few rounds later. A batch is
folded early when anything else is about to happen (a probe, a plain recheck, another bucket, a
round of another option). An engine whose device runs ahead of the host (CUDA) folds them itself
while the next round runs (:meth:`fold_settled`), so the fold costs no round anything and a change
of the best option is acted on one round later. With the scores recomputed after every round,
``choose`` + ``record`` cost 65-94 us of host time per round in a busy H200 engine, 1.2-1.7% of a
5.4 ms plain round at Qwen3-8B shape, while the device waited (benchmarks/README.md, "Twelfth
session"; 2.3x less so on a CPU, ``benchmarks/cpu_policy_cost.py``).
Everything is deterministic given the same measurements.

The node count only changes the shape of a round, never which tokens are committed: every
option is lossless, so the policy is free to pick any of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import NamedTuple, Sequence

from flashtree.errors import ConfigError

PLAIN_NODES = 0  # the plain option: root-only tree, no drafter pass
PLAIN_ACCEPTANCE = 1.0  # a plain round commits exactly its bonus token
OUTLIER_FACTOR = 2.0  # round-time samples are clipped to this multiple of the current estimate
DOMINATED = 0.5  # exploration skips options measured below this fraction of the best tokens/s
BACKOFF_BELOW = 0.8  # a probe below this fraction of the best tokens/s doubles the probe interval
PROBE_WEIGHT = 0.75  # EMA weight of a probe's measurements (at least; the estimate it refreshes is old)
# what a probe is (see "Rechecks" and "Plain rechecks" above)
NEIGHBOUR_PROBE = 0  # a regular probe of a ladder neighbour of the best option
RECHECK_NOW = 1  # the immediate recheck of the option an ordinary round displaced
RECHECK_LATER = 2  # the next probe's recheck of it, after the immediate one confirmed the change
PLAIN_RECHECK = 3  # plain rounds, re-measured while a tree is chosen


@dataclasses.dataclass(frozen=True)
class SpecPolicyConfig:
    """Knobs of :class:`SpecPolicy` (validated, frozen)."""

    smoothing: float = 0.2  # EMA weight of the newest round time (the first ones are averaged)
    acceptance_smoothing: float = 0.05  # the same per row for acceptance lengths (a noisy small integer)
    explore_rounds: int = 2  # timed rounds of every option per rows bucket before trusting estimates
    probe_interval: int = 50  # rounds of a bucket between tries of a neighbour of the best option
    max_probe_interval: int = 800  # the interval doubles after each probe that changes nothing, up to this
    # (or to what probe_cost_share needs, if more)
    min_tree_nodes: int = 4  # smallest non-zero tree in a DDTree ladder (halving stops above it)
    probe_rounds: int = 4  # rows x rounds of a probe (consecutive rounds, averaged into one measurement)
    plain_recheck_interval: int = 200  # rounds of a bucket on trees after which plain is re-measured
    settled_batch: int = 8  # settled rounds (the best option, nothing due) folded into the estimates at a time
    probe_cost_share: float | None = 0.001  # most of a bucket's time a probe that changes nothing may cost
    # (its interval is stretched past max_probe_interval to keep it so; None: no such floor)

    def __post_init__(self) -> None:
        for name in ("smoothing", "acceptance_smoothing"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("explore_rounds", "probe_interval", "max_probe_interval", "min_tree_nodes", "probe_rounds",
                     "plain_recheck_interval", "settled_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.probe_cost_share is not None and not 0.0 < self.probe_cost_share <= 1.0:
            raise ConfigError(f"probe_cost_share must be in (0, 1] or None, got {self.probe_cost_share!r}")
        if self.max_probe_interval < self.probe_interval:
            raise ConfigError(f"max_probe_interval ({self.max_probe_interval}) must be >= probe_interval "
                              f"({self.probe_interval})")


def node_ladder(max_nodes: int, chain: bool, min_tree_nodes: int = 4) -> tuple[int, ...]:
    """The node counts a round may verify, largest first, ending with 0 (plain).

    Chains (DFlash): the full block or nothing. Trees (DDTree): ``max_nodes`` halved down to
    ``min_tree_nodes``, e.g. 256 -> (256, 128, 64, 32, 16, 8, 4, 0).
    """
    if max_nodes <= 0:
        return (PLAIN_NODES,)
    if chain:
        return (max_nodes, PLAIN_NODES)
    ladder = [max_nodes]
    while ladder[-1] // 2 >= min_tree_nodes:
        ladder.append(ladder[-1] // 2)
    return (*ladder, PLAIN_NODES)


def rows_bucket(rows: int) -> int:
    """The timing bucket of a batch: the next power of two at or above ``rows`` (1, 2, 4, ...)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


class _Ema:
    """An exponential moving average whose first ``1 / smoothing`` samples are a plain mean
    (so a first outlier does not linger); ``clip`` bounds a sample to that multiple of the
    current value."""

    __slots__ = ("value", "count", "smoothing", "clip")

    def __init__(self, smoothing: float, clip: float | None = None):
        self.value, self.count, self.smoothing, self.clip = 0.0, 0, smoothing, clip

    def add(self, sample: float, least_weight: float = 0.0) -> None:
        if self.clip is not None and self.count:
            sample = min(sample, self.clip * self.value)
        self.count += 1
        weight = max(self.smoothing, 1.0 / self.count, least_weight)
        self.value += weight * (sample - self.value)


class _BucketEstimates(NamedTuple):
    """What a rows bucket's estimates say, as of measurement number ``version``."""

    version: int
    scores: dict  # option -> tokens/s per row (None while unmeasured)
    best: int  # the option with the highest score
    bounds: dict  # option -> upper bound on its score (see SpecPolicy._bound)
    unexplored: list  # options still to explore (see SpecPolicy._unexplored)


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


class SpecPolicy:
    """Picks each round's node count from ``ladder`` (see the module docstring)."""

    def __init__(self, ladder: Sequence[int], config: SpecPolicyConfig = SpecPolicyConfig()):
        if not ladder or len(set(ladder)) != len(ladder) or min(ladder) < 0:
            raise ValueError(f"ladder must be distinct node counts >= 0, got {tuple(ladder)}")
        self.ladder = tuple(sorted(ladder, reverse=True))
        self.config = config
        self._acceptance: dict[int, _Ema] = {}  # nodes -> mean acceptance length
        self._seconds: dict[tuple[int, int], _Ema] = {}  # (rows bucket, nodes) -> round seconds
        self._rounds: Counter[int] = Counter()  # rows bucket -> rounds chosen for it
        self._interval: dict[int, int] = {}  # rows bucket -> rounds between probes (backs off)
        self._next_probe: dict[int, int] = {}  # rows bucket -> round count at which to probe
        self._probes: Counter[int] = Counter()  # rows bucket -> probes so far (alternates up / down)
        self._probe: _Probe | None = None  # the probe in progress
        self._recheck: dict[int, tuple[int, int]] = {}  # rows bucket -> (displaced option the next probe
        # re-measures, RECHECK_NOW or RECHECK_LATER)
        self._plain_timed_at: dict[int, int] = {}  # rows bucket -> its round count when plain was last timed
        self._timed_at: dict[tuple[int, int], int] = {}  # (rows bucket, nodes) -> the bucket's round count
        # when that option was last timed (fed in; for held settled rounds, when they were folded)
        self._measurements = 0  # estimates fed so far (the score cache's version)
        self._score_cache: dict[int, _BucketEstimates] = {}  # rows bucket -> its estimates, as last computed
        self._settled: list[tuple] = []  # held settled rounds: (rows, nodes, seconds, acceptance), one bucket
        self._settled_bucket = 0  # the bucket of the held rounds

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
        unexplored = self._unexplored(bucket)
        if unexplored:
            return min(unexplored, key=lambda n: (self._timed(bucket, n), n))  # smaller first: it bounds the rest
        best = self.best(rows)
        if self._plain_recheck_due(bucket, best, self._rounds[bucket]):
            self._plain_timed_at[bucket] = self._rounds[bucket]  # (also if its rounds go untimed: no retry each round)
            self._probe = _Probe(PLAIN_NODES, bucket, best, rounds_left=self._probe_rounds(rows) - 1,
                                 recheck=PLAIN_RECHECK)
            return PLAIN_NODES
        if self._rounds[bucket] >= self._next_probe.setdefault(bucket, self._rounds[bucket] + self.config.probe_interval):
            self._probes[bucket] += 1
            displaced, recheck = self._recheck.pop(bucket, (None, NEIGHBOUR_PROBE))
            if displaced in (None, best):
                displaced, recheck = self._neighbour(best, larger=self._probe_larger(bucket, best)), NEIGHBOUR_PROBE
            self._probe = _Probe(displaced, bucket, best, rounds_left=self._probe_rounds(rows) - 1, recheck=recheck)
            return displaced
        return best

    def settled_on_plain(self, rows: int) -> bool:
        """A plain round of ``rows`` rows is a settled one (see :meth:`_is_settled`: no probe in
        progress, the bucket explored, plain its best option). One more plain round's measurement
        then hardly matters, so the engine may call :meth:`choose` for the next round before
        :meth:`record` of the current one (and queue the next round early if it is plain: engine.py,
        "Queued plain rounds")."""
        return self._is_settled(rows_bucket(rows), PLAIN_NODES)

    def _decision_due(self, bucket: int) -> bool:
        """The next round of ``bucket`` starts a plain recheck or a neighbour probe (as ``choose``
        decides them; the estimates are current enough for the best option: it is the held one)."""
        rounds = self._rounds[bucket] + 1
        return (self._plain_recheck_due(bucket, self._settled[-1][1], rounds)
                or rounds >= self._next_probe.get(bucket, rounds + 1))

    def _plain_recheck_due(self, bucket: int, best: int, rounds: int) -> bool:
        """At round ``rounds`` of ``bucket``, with a tree as the ``best`` option, plain has gone
        ``plain_recheck_interval`` rounds unmeasured (see "Plain rechecks" above)."""
        return best != PLAIN_NODES and PLAIN_NODES in self.ladder and (
            rounds - self._plain_timed_at.get(bucket, 0) >= self.config.plain_recheck_interval)

    @property
    def probing(self) -> bool:
        """The round just chosen belongs to a neighbour probe: not to exploration, the best option,
        a recheck (whose timing is the point of it) or a plain recheck. The engine may decline such
        a round (:meth:`decline_probe`) when its CUDA graph is not captured yet and
        :meth:`worth_a_graph` says no (engine.py, "Probes and CUDA graphs")."""
        return self._probe is not None and self._probe.recheck == NEIGHBOUR_PROBE

    def worth_a_graph(self, rows: int, nodes: int) -> bool:
        """Whether ``nodes`` could beat the best option of ``rows``' bucket: its bound (acceptance
        over the round time of the largest smaller option timed in the bucket, see :meth:`_bound`)
        is above the best option's score. A drafter that never matches (acceptance 1) makes no
        tree worth it: its bound is plain rounds' score."""
        bucket = rows_bucket(rows)
        scores, best = self._scores(bucket)
        top = scores.get(best)
        return top is None or self._bound(bucket, nodes) > top

    def decline_probe(self) -> None:
        """The engine did not run the neighbour probe just chosen (it would have captured a graph
        for an option not :meth:`worth_a_graph`): the probe ends unmeasured, and the next one
        waits twice as long (up to ``max_probe_interval``), as after a probe that found its option
        clearly worse."""
        probe, self._probe = self._probe, None
        if probe is None or probe.recheck != NEIGHBOUR_PROBE:
            raise RuntimeError("decline_probe() needs a neighbour probe in progress (see probing)")
        interval = min(2 * self._interval.get(probe.bucket, self.config.probe_interval), self.config.max_probe_interval)
        self._interval[probe.bucket] = interval
        self._next_probe[probe.bucket] = self._rounds[probe.bucket] + interval

    def _probe_rounds(self, rows: int) -> int:
        """Rounds of a probe at ``rows`` rows: enough for ``probe_rounds`` rows' worth of rounds
        (each row's acceptance is one sample), at least one."""
        return max(1, -(-self.config.probe_rounds // rows))

    def best(self, rows: int) -> int:
        """The option with the highest estimated tokens/s (ties: fewer nodes); options without
        estimates are skipped (plain always has one once timed)."""
        return self._scores(rows_bucket(rows))[1]

    def _scores(self, bucket: int) -> tuple[dict[int, float | None], int]:
        """Per option of ``bucket`` its tokens/s per row (None while unmeasured), and the best
        option; recomputed only after a measurement (a round asks for them several times)."""
        cached = self._estimates(bucket)
        return cached.scores, cached.best

    def _estimates(self, bucket: int) -> "_BucketEstimates":
        """The bucket's scores, best option, bounds and options still to explore, recomputed only
        after a measurement: a settled round asks for them several times, and a round's host time
        is time the device waits (tens of microseconds per round in a busy engine)."""
        cached = self._score_cache.get(bucket)
        if cached is not None and cached.version == self._measurements:
            return cached
        scores, bounds = self._per_row_all(bucket)
        known = [(score, -n) for n, score in scores.items() if score is not None]
        best = -max(known)[1] if known else self.ladder[-1]
        cached = _BucketEstimates(self._measurements, scores, best, bounds, [])
        cached.unexplored.extend(self._options_to_explore(bucket, cached))
        self._score_cache[bucket] = cached
        return cached

    def tokens_per_second(self, rows: int, nodes: int) -> float | None:
        """Expected throughput of a round of ``nodes`` nodes, None while unmeasured."""
        per_row = self._per_row(rows_bucket(rows), nodes)
        return None if per_row is None else rows * per_row

    def _per_row(self, bucket: int, nodes: int) -> float | None:
        """acceptance / round seconds: tokens/s per row of the bucket, None while unmeasured. The
        seconds are the largest estimate of the option and every smaller option timed in the
        bucket (see "Monotone round times" above)."""
        return self._estimates(bucket).scores.get(nodes)

    def _per_row_all(self, bucket: int) -> tuple[dict[int, float | None], dict[int, float]]:
        """:meth:`_per_row` and :meth:`_bound` of every option, in one pass up the ladder."""
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

    def snapshot(self, rows: int) -> dict[str, list]:
        """The estimates for ``rows``' bucket, per ladder option: [nodes, acceptance, ms, timed rounds]."""
        bucket = rows_bucket(rows)
        options = []
        for n in self.ladder:
            seconds = self._seconds.get((bucket, n))
            acceptance = self.acceptance(n)
            options.append([n, None if acceptance is None else round(acceptance, 4),
                            None if seconds is None else round(seconds.value * 1000, 4), self._timed(bucket, n)])
        return {"options": options, "next_probe": self._next_probe.get(bucket)}

    def acceptance(self, nodes: int) -> float | None:
        """Mean acceptance length estimate (bonus included); exactly 1 for plain rounds."""
        if nodes == PLAIN_NODES:
            return PLAIN_ACCEPTANCE
        ema = self._acceptance.get(nodes)
        return ema.value if ema is not None else None

    def _unexplored(self, bucket: int) -> list[int]:
        """Options still to try in ``bucket``: too few timed rounds and not clearly worse than the
        best, measured or bounded (:meth:`_bound`); an option not yet timed must also be able to
        beat plain rounds (its bound above plain's score; see "Exploration" above)."""
        return self._estimates(bucket).unexplored

    def _options_to_explore(self, bucket: int, estimates: "_BucketEstimates") -> list[int]:
        """:meth:`_unexplored`, computed from the bucket's fresh estimates."""
        scores = estimates.scores
        top = max((s for s in scores.values() if s is not None), default=0.0)
        plain = scores.get(PLAIN_NODES)

        def worth_trying(n: int) -> bool:
            if scores[n] is not None:
                return scores[n] >= DOMINATED * top
            bound = estimates.bounds[n]
            return bound >= DOMINATED * top and (plain is None or bound > plain)

        return [n for n in self.ladder if self._timed(bucket, n) < self.config.explore_rounds and worth_trying(n)]

    def _bound(self, bucket: int, nodes: int) -> float:
        """An upper bound on the tokens/s per row of an option not yet timed in ``bucket``: its
        acceptance (known from other buckets) over the round time of the largest smaller option
        timed here (verifying more nodes never costs less); infinite without both."""
        return self._estimates(bucket).bounds[nodes]

    def _explored(self, bucket: int) -> bool:
        """Exploration of ``bucket`` is over (the estimates, not round robin, pick its options)."""
        return not self._unexplored(bucket)

    def _timed(self, bucket: int, nodes: int) -> int:
        ema = self._seconds.get((bucket, nodes))
        return ema.count if ema is not None else 0

    def _probe_larger(self, bucket: int, best: int) -> bool:
        """Whether a neighbour probe of ``bucket`` tries the larger neighbour of ``best``: the one
        of the two timed longer ago (never: longest ago), alternately on a tie. In a settled
        bucket that alternates; after the best option moved it first tries the side the move did
        not come from (its estimate is the staler one)."""
        index = self.ladder.index(best)
        if index == 0 or index == len(self.ladder) - 1:
            return index != 0  # one neighbour only
        larger = self._timed_at.get((bucket, self.ladder[index - 1]), -1)
        smaller = self._timed_at.get((bucket, self.ladder[index + 1]), -1)
        return larger < smaller if larger != smaller else self._probes[bucket] % 2 == 1

    def _neighbour(self, nodes: int, larger: bool) -> int:
        """The ladder option next to ``nodes``: the larger one if asked and there is one."""
        index = self.ladder.index(nodes)
        up = self.ladder[index - 1] if index > 0 else None
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
        if self._is_settled(bucket, nodes):  # see "Settled rounds" above
            self._settled.append((rows, nodes, seconds, acceptance))
            self._settled_bucket = bucket
            if len(self._settled) >= self.config.settled_batch:
                self._fold_held()
            return
        self._fold_held()  # (measurements go in in order)
        best_before = self.best(rows) if self._explored(bucket) else None
        self._measure(bucket, nodes, seconds, acceptance, weight=0.0, rows=rows, pace=nodes == best_before)
        self._check_best_moved(bucket, best_before)

    def _is_settled(self, bucket: int, nodes: int) -> bool:
        """A round of ``nodes`` is a settled one: no probe in progress, ``bucket`` explored and
        ``nodes`` its best option (by the estimates as last computed), the held rounds' bucket."""
        if self.config.settled_batch == 1 or self._probe is not None:
            return False
        if self._settled and bucket != self._settled_bucket:
            return False
        cached = self._score_cache.get(bucket)
        return cached is not None and cached.version == self._measurements and not cached.unexplored \
            and cached.best == nodes

    def fold_settled(self) -> None:
        """The held settled rounds into the estimates, in order; the best option is recomputed once.
        An engine whose device runs ahead of the host calls this while a round runs: the fold then
        costs the round nothing (see "Settled rounds" above)."""
        self._fold_held()

    def _fold_held(self) -> None:
        """:meth:`fold_settled`, as the policy itself calls it (when a batch is full or something
        else is about to happen)."""
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
        was still exploring): the displaced option is rechecked at the next round (see "Rechecks")."""
        if best_before is not None and self.best(bucket) != best_before:
            self._recheck[bucket] = (best_before, RECHECK_NOW)
            self._interval[bucket] = self.config.probe_interval
            self._next_probe[bucket] = self._rounds[bucket]  # the next round

    def _measure(self, bucket: int, nodes: int, seconds: float | None, acceptance: float | None,
                 weight: float, rows: int = 1, pace: bool = False) -> None:
        """Feed one measurement (``weight``: the least EMA weight it gets; ``rows``: rows whose mean
        acceptance it is) to the estimates. ``pace``: a round of the bucket's best option, whose
        change of estimate every other option's round-time estimate follows (see "Common pace")."""
        self._measurements += 1
        if seconds is not None and nodes == PLAIN_NODES:
            self._plain_timed_at[bucket] = self._rounds[bucket]
        if seconds is not None:
            ema = self._seconds.get((bucket, nodes))
            if ema is None:
                ema = self._seconds[(bucket, nodes)] = _Ema(self.config.smoothing, OUTLIER_FACTOR)
            before = ema.value
            ema.add(seconds, weight)
            if pace and before > 0.0:
                self._follow_pace(bucket, nodes, ema.value / before)
            self._timed_at[(bucket, nodes)] = self._rounds[bucket]
        if acceptance is not None and nodes != PLAIN_NODES:
            per_rows = 1.0 - (1.0 - self.config.acceptance_smoothing) ** rows  # each row one sample
            self._acceptance.setdefault(nodes, _Ema(self.config.acceptance_smoothing)).add(
                acceptance, max(weight, per_rows))

    def _follow_pace(self, bucket: int, paced_by: int, ratio: float) -> None:
        """Scale the round-time estimates of ``bucket``'s options other than ``paced_by`` by
        ``ratio``, the change of ``paced_by``'s estimate (see "Common pace" above)."""
        for nodes in self.ladder:
            ema = self._seconds.get((bucket, nodes))
            if ema is not None and nodes != paced_by:
                ema.value *= ratio

    def _finish_probe(self) -> None:
        """The probe's rounds, averaged, as one heavily weighted measurement; then the next probe
        is scheduled."""
        probe, self._probe = self._probe, None
        mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
        self._measure(probe.bucket, probe.nodes, mean(probe.seconds), mean(probe.acceptance), PROBE_WEIGHT)
        if probe.recheck == PLAIN_RECHECK and self.best(probe.bucket) == probe.best_before:
            return  # a plain recheck that changed nothing: the neighbour probes keep their schedule
        self._schedule_next_probe(probe.bucket, probe.nodes, probe.best_before, probe.recheck,
                                  probe_rounds=max(1, len(probe.seconds)))

    def _schedule_next_probe(self, bucket: int, probed: int, best_before: int, recheck: int = NEIGHBOUR_PROBE,
                             probe_rounds: int = 1) -> None:
        """Back off after a probe of a clearly worse option (at least to the interval that keeps
        such probes' cost under ``probe_cost_share``, see "Probe cost" above); probe again soon after
        one that changed the best option, or after an immediate recheck that confirmed a change
        (then the next probe rechecks the displaced option again); keep the interval otherwise."""
        interval = self._interval.get(bucket, self.config.probe_interval)
        best = self.best(bucket)
        probed_rate, best_rate = self._per_row(bucket, probed), self._per_row(bucket, best)
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
        rounds lose the time it would take the best option to make their tokens faster,
        ``rounds x seconds(probed) x (1 - rate_ratio)`` (rate_ratio: rate(probed) / rate(best)), against
        ``interval x seconds(best)`` of the rounds in between (see "Probe cost" above)."""
        share = self.config.probe_cost_share
        probed_seconds, best_seconds = self._seconds.get((bucket, probed)), self._seconds.get((bucket, best))
        if share is None or probed_seconds is None or best_seconds is None:
            return 0
        lost = probe_rounds * probed_seconds.value * max(0.0, 1.0 - rate_ratio)
        return math.ceil(lost / (share * max(best_seconds.value, 1e-9)))


class FixedNodes:
    """Today's fixed behaviour with the policy's interface: every round verifies ``nodes``."""

    probing = False  # (never probes)

    def __init__(self, nodes: int):
        self.ladder = (nodes,)

    def choose(self, rows: int) -> int:
        return self.ladder[0]

    def settled_on_plain(self, rows: int) -> bool:
        return self.ladder[0] == PLAIN_NODES

    def record(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None) -> None:
        pass

    def fold_settled(self) -> None:
        pass
