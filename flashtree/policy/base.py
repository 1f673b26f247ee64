"""The speculation policy's interface: which node count each round verifies.

Glossary
- nodes: drafted nodes per row a round verifies (0: a plain round, no drafter pass).
- ladder: the node counts a policy may choose from, largest first, ending with 0 when plain rounds
  are allowed (:func:`node_ladder`).
- rows bucket: the timing bucket of a batch, the next power of two at or above its rows
  (:func:`rows_bucket`); round times are kept per bucket.
- option: one ladder entry of one rows bucket.

Every option is lossless: the node count only changes the shape of a round, never which tokens
are committed, so a policy is free to pick any of them.
"""

from __future__ import annotations

from typing import Callable, Protocol

PLAIN_NODES = 0  # the plain option: root-only tree, no drafter pass
PLAIN_ACCEPTANCE = 1.0  # a plain round commits exactly its bonus token


class Policy(Protocol):
    ladder: tuple[int, ...]  # the node counts it chooses from, largest first

    @property
    def probing(self) -> bool:
        """The round just chosen is a neighbour probe, which the engine may decline
        (:meth:`decline_probe`) when its CUDA graph is not captured and it is not worth one."""

    def choose(self, rows: int) -> int:
        """The node count of the next round of ``rows`` rows."""

    def best(self, rows: int) -> int:
        """The option the estimates rate best for ``rows`` rows (what a declined probe runs)."""

    def settled_on_plain(self, rows: int) -> bool:
        """A plain round of ``rows`` rows changes nothing but the estimates: the next round may be
        chosen, and queued, before this one's measurement is recorded."""

    def record(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None) -> None:
        """What a round measured: its wall time (None: not representative) and its rows' mean
        acceptance length (None: no row could use the full node count)."""

    def fold_settled(self) -> None:
        """Fold held measurements in (the engine calls it while the device runs a round)."""

    def round_costs(self, rows: int, nodes: int) -> list[float] | None:
        """A round of ``rows`` rows and ``nodes`` nodes: its cost by verified tokens ``0 .. rows x
        (nodes + 1)``, from which each row's budget is chosen from its own tree
        (``policy/row_budgets.py``); None: every row verifies the round's nodes."""

    def record_width(self, rows: int, width: int, seconds: float) -> None:
        """A drafted round of ``rows`` rows that verified ``width`` entries per row (its widest tree
        plus the root) took ``seconds``."""

    def worth_a_graph(self, rows: int, nodes: int) -> bool:
        """Whether ``nodes`` could beat the best option for ``rows`` rows."""

    def decline_probe(self) -> None:
        """The engine did not run the neighbour probe just chosen."""

    def snapshot(self, rows: int) -> dict | None:
        """The estimates for ``rows`` rows, for traces (None: the policy keeps none)."""

    def widest_round(self, max_rows: int) -> tuple[int, int]:
        """(rows, nodes) of the round with the most verified tokens it may choose for up to ``max_rows`` rows
        (what the engine's activation reserve measures, ``engine/memory_profile.py``)."""


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


def round_fits(bucket: int, nodes: int, max_round_tokens: int | None) -> bool:
    """A round of ``bucket`` rows and ``nodes`` nodes may run under the bound ``max_round_tokens`` on the
    tokens it verifies (``bucket x (nodes + 1)``; None: no bound). A plain round always may."""
    return nodes == PLAIN_NODES or max_round_tokens is None or bucket * (nodes + 1) <= max_round_tokens


def widest_fitting(ladder: tuple[int, ...], max_rows: int, fits: Callable[[int, int], bool]) -> tuple[int, int]:
    """(rows, nodes) of the round verifying the most tokens over ``ladder``'s options and up to ``max_rows`` rows,
    where ``fits(bucket, nodes)`` says which options a rows bucket may run: for each option the most rows whose
    bucket allows it (a smaller bucket's whole batch where a larger one's round would verify too many tokens)."""
    options = []
    for nodes in ladder:
        rows = max_rows
        while rows > 1 and not fits(rows_bucket(rows), nodes):
            rows = rows_bucket(rows) // 2
        if fits(rows_bucket(rows), nodes):
            options.append((rows * (nodes + 1), nodes, rows))
    _, nodes, rows = max(options)
    return rows, nodes


def rows_bucket(rows: int) -> int:
    """The timing bucket of a batch: the next power of two at or above ``rows`` (1, 2, 4, ...)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


class FixedNodes:
    """Every round verifies ``nodes`` (speculation without the adaptive policy, or plain decoding), or, where
    a round of that many would verify more than ``max_round_tokens`` tokens (rows bucket x (nodes + 1)), the
    largest option of ``ladder`` that fits: a smaller tree, or plain for a chain (as vLLM trims speculative
    tokens to its max_num_batched_tokens). Without a bound the ladder is ``(nodes,)``."""

    probing = False  # (never probes)

    def __init__(self, nodes: int, ladder: tuple[int, ...] | None = None, max_round_tokens: int | None = None):
        if ladder is not None and (ladder[0] != nodes or ladder[-1] != PLAIN_NODES):
            raise ValueError(f"a bounded fixed policy's ladder runs from its node count {nodes} down to plain, "
                             f"got {ladder}")
        self.ladder = ladder if ladder is not None else (nodes,)
        self.max_round_tokens = max_round_tokens

    def choose(self, rows: int) -> int:
        if self.max_round_tokens is None:
            return self.ladder[0]
        bucket = rows_bucket(rows)
        return next((n for n in self.ladder if round_fits(bucket, n, self.max_round_tokens)), PLAIN_NODES)

    best = choose

    def settled_on_plain(self, rows: int) -> bool:
        return self.choose(rows) == PLAIN_NODES

    def record(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None) -> None:
        pass

    def fold_settled(self) -> None:
        pass

    def round_costs(self, rows: int, nodes: int) -> list[float] | None:
        return None  # every row at the fixed count

    def record_width(self, rows: int, width: int, seconds: float) -> None:
        pass

    def worth_a_graph(self, rows: int, nodes: int) -> bool:
        return True

    def decline_probe(self) -> None:
        raise RuntimeError("a fixed node count never probes")

    def snapshot(self, rows: int) -> dict | None:
        return None

    def widest_round(self, max_rows: int) -> tuple[int, int]:
        return widest_fitting(self.ladder, max_rows, lambda bucket, nodes: round_fits(bucket, nodes, self.max_round_tokens))
