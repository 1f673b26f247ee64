"""``--max-minutes``: stop a run early enough that its save (and final eval) end before a limit.

A device call is killed at its limit; a run that is still stepping then loses everything since its
last save. :class:`Deadline` is told how long steps and the finishing work take as they are
measured, and says stop when the next step plus the finishing work would not fit any more.
"""

from __future__ import annotations

import time

SAFETY = 1.5  # measured durations are multiplied by this (a slow step, a slow disk)
FIRST_FINISH_ESTIMATE_S = 5.0  # finishing work before any save or eval was timed


class Deadline:
    """``limit_s`` seconds after ``started_at`` (a ``time.perf_counter()`` reading)."""

    def __init__(self, limit_s: float, started_at: float, eval_batches: int = 0):
        self.ends_at = started_at + limit_s
        self.eval_batches = eval_batches
        self.longest_step_s = 0.0
        self.save_s: float | None = None
        self.eval_s: float | None = None

    def step_took(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, seconds)

    def save_took(self, seconds: float) -> None:
        self.save_s = seconds

    def eval_took(self, seconds: float) -> None:
        self.eval_s = seconds

    def finish_estimate_s(self) -> float:
        """The final eval and save: as measured, else a step per eval batch and a guess for the save."""
        evaluation = self.eval_s if self.eval_s is not None else self.eval_batches * self.longest_step_s
        saving = self.save_s if self.save_s is not None else FIRST_FINISH_ESTIMATE_S
        return evaluation + saving

    def should_stop(self, now: float | None = None) -> bool:
        now = time.perf_counter() if now is None else now
        return now + SAFETY * (self.longest_step_s + self.finish_estimate_s()) >= self.ends_at
