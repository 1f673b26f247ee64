"""Queued plain rounds: the next plain round goes to the device before the host reads this one's results.

Between two rounds the host appends the committed tokens (stop checks, text), schedules and builds
the next round's inputs: time the device sits idle when each round waits for the one before it to
be read. A plain round's successor needs nothing the host has to read first: its bonus token is the
one the round chooses (on the device), and its positions, output count and drafter lag are one
further. So when this round is plain, the policy is settled on plain rounds and no prefill runs this
step, the next round's node count is chosen before this round's results are read; if it is plain,
that round is queued right behind this one (``ModelRunner.launch_plain_after``, with the drafter's
catch-up first when a row's lag fills), and the device runs it while the host does this step's work.
Otherwise the chosen count is kept for the next step.

Rows that finish in this step (a stop token, an abort) ran one more token in the queued round; it is
dropped, and their slots are freed behind it on the device. Only plain rounds are queued: a drafted
round's successor depends on how many tokens it accepts. Lossless as before: a queued round computes
exactly what the same round run a step later would.
"""

from __future__ import annotations

from typing import Callable, Sequence

from flashtree.engine.request import Request
from flashtree.engine.runner import LaunchedRound, ModelRunner
from flashtree.policy.base import Policy
from flashtree.speculative.drafter import DrafterLag


class QueuedRounds:
    def __init__(self, runner: ModelRunner, lag: DrafterLag, max_context: int, enabled: bool):
        self.runner, self.lag, self.max_context, self.enabled = runner, lag, max_context, enabled
        self.ahead: LaunchedRound | None = None  # the round queued for the next step
        self.chosen: int | None = None  # the next round's node count, chosen in the last step
        self.taken = 0  # rounds that were queued before the round ahead of them was read

    def take(self, rows: Sequence[Request]) -> LaunchedRound | None:
        """The round queued for ``rows`` in the last step, if it serves them (the queued rows that
        have not finished since, in the same order); otherwise its results are dropped."""
        queued, self.ahead = self.ahead, None
        if queued is None or not _serves(queued.rows, rows):
            return None
        self.taken += 1
        return queued

    def take_chosen(self) -> int | None:
        """The node count the last step chose for this round, if it did."""
        nodes, self.chosen = self.chosen, None
        return nodes

    def clear(self) -> None:
        """No rows run (they have all finished since)."""
        self.ahead = self.chosen = None

    def queue_after(self, launched: LaunchedRound, policy: Policy, choose: Callable[[Sequence[Request]], int]) -> bool:
        """Choose the round after ``launched`` now and queue it if it is plain (see the module
        docstring); returns whether the queued round catches the drafter up first."""
        if not self._may_queue_after(launched, policy):
            return False
        nodes = choose(launched.rows)
        catches_up = False
        if nodes == 0:
            catches_up = self.lag.full_after_plain(launched.rows)
            self.ahead = self.runner.launch_plain_after(launched, catches_up)
        if self.ahead is None:  # a drafted round, or a graph is not captured yet: the next step runs it
            self.chosen = nodes
        return catches_up and self.ahead is not None

    def _may_queue_after(self, launched: LaunchedRound, policy: Policy) -> bool:
        """``launched`` is plain and has no grammar rows, the policy is settled on plain rounds (its choice
        then hardly depends on this round's measurement) and every row has room for two more tokens."""
        if not self.enabled or launched.nodes != 0 or not policy.settled_on_plain(len(launched.rows)):
            return False
        if launched.constrained:  # its grammar rows' masks need the tokens it chooses
            return False
        limit = self.max_context - 2
        return all(r.committed_length < limit for r in launched.rows)


def _serves(queued_rows: Sequence[Request], rows: Sequence[Request]) -> bool:
    live = [r for r in queued_rows if not r.finished]
    return len(live) == len(rows) and all(a is b for a, b in zip(live, rows))
