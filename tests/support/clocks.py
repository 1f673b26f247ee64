"""Clocks for engine tests whose outcome would otherwise depend on how fast this machine runs.

The engine times its rounds (for the speculation policy), its idle pauses (``IDLE_GAP_S``) and its
traces with ``time.perf_counter`` in ``flashtree.engine.engine``, ``flashtree.engine.stage_timer``
and ``flashtree.engine.traces``. A test that checks what the policy chose, which rounds went
untimed, or what a trace recorded patches them with a :class:`ReadCountClock`, and expresses pauses
and costs in that clock (``clock.sleep``) instead of sleeping: the same measurements on every
machine and run, whatever else the host is doing. :func:`modelled_round_times` goes further and
feeds the policy a cost model instead of the measured times.
"""

from __future__ import annotations

import time


class ReadCountClock:
    """A stand-in for a module's ``time`` whose ``perf_counter`` advances ``tick`` (1 ms) per read:
    a round's measured time is then a count of the engine's clock reads, the same on every machine
    and run (a drafter that always matches must not depend on a host hiccup during one timed round
    of exploration, which once made the policy skip an option in a full CI-like run). ``sleep``
    advances the clock without waiting (a pause, or a cost in modelled seconds); everything else is
    the real ``time`` module's."""

    def __init__(self, tick: float = 1e-3):
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def use_read_count_clock(monkeypatch) -> ReadCountClock:
    """Patch the clock of the engine, its stage timer and its traces with a fresh
    :class:`ReadCountClock` (engines built before or after the call both read it); returns it."""
    import flashtree.engine.engine as engine_module
    import flashtree.engine.stage_timer as stage_timer_module
    import flashtree.engine.traces as traces_module

    clock = ReadCountClock()
    for module in (engine_module, stage_timer_module, traces_module):
        monkeypatch.setattr(module, "time", clock)
    return clock


def modelled_round_times(policy, monkeypatch) -> None:
    """Feed ``policy`` modelled round times instead of measured ones: 1 ms plus 0.25 ms per drafted
    node (untimed rounds stay untimed). A loaded machine (CI runs other jobs) makes wall times
    scatter enough that a tree could look best for a while, and rechecks (not neighbour probes) then
    take the probe rounds; a random drafter's trees (acceptance near 1) always cost more than they
    give here, so the policy settles on plain rounds on every machine."""
    real_record = policy.record

    def record(rows, nodes, seconds, acceptance):
        real_record(rows, nodes, None if seconds is None else 1e-3 * (1.0 + nodes / 4), acceptance)

    monkeypatch.setattr(policy, "record", record)
