"""Trace files: JSON lines that observe the engine and never change what it runs.

- ``--trace-trees FILE`` (:class:`TreeTracer`): one line per request per round with the verified tree
  (node tokens and parents, root first) and the accepted path (node indices, root first). The round
  returns its tree tensors beside its result (inside its CUDA graph too), and the host writes them
  after the round's one sync. :class:`RecentTrees` keeps the same records in memory instead, each
  request's last few (``--recent-trees``: what the playground draws).
- ``--trace-policy FILE`` (:class:`PolicyTracer`): one line per batched round with the speculation
  policy's choice, what the round measured, and the policy's estimates afterwards.
- ``--trace-steps FILE`` (:class:`StepTracer`): one short line per engine step with where its time
  went: ``gap_ms`` since the previous step ended, ``round_ms`` (null without a round), ``prefill_ms``
  (null without a prefill chunk), ``step_ms`` in all; the round's ``rows`` and ``nodes``, and
  ``prefill_rows``. Lines are buffered and written every ``STEP_FLUSH_EVERY`` steps and at exit.

Every trace appends to a :class:`JsonLines` file.
"""

from __future__ import annotations

import atexit
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from flashtree.engine.request import Request
from flashtree.policy.base import Policy

STEP_FLUSH_EVERY = 512  # steps between writes of a step trace


class JsonLines:
    def __init__(self, path: str | Path, flush_every: int = 1):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", encoding="utf-8")
        self.flush_every = flush_every
        self.pending: list[str] = []
        if flush_every > 1:
            atexit.register(self.flush)

    def write(self, *records: dict) -> None:
        self.pending.extend(json.dumps(record) for record in records)
        if len(self.pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.pending and not self.file.closed:
            self.file.write("\n".join(self.pending) + "\n")
            self.file.flush()
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.flush_every > 1:
            atexit.unregister(self.flush)


def tree_records(rows: Sequence[Request], trace: Sequence[torch.Tensor]) -> list[tuple[Request, dict]]:
    """Per row of a round whose results the host has read: its tree record. ``trace`` = (tokens,
    parents, valid ``[B, N]``, path ``[B, P]``) on the host, pad rows after the real ones. A row that
    finished after the round was queued gets none: its result is dropped."""
    tokens, parents, valid, path = (t.tolist() for t in trace)
    records = []
    for b, req in enumerate(rows):
        if req.finished:
            continue
        count = sum(valid[b])  # valid nodes are a leading run: root, then drafted nodes
        records.append((req, {"request_id": req.request_id, "round": req.stats.rounds, "tokens": tokens[b][:count],
                              "parents": parents[b][:count], "accepted_path": [n for n in path[b] if n >= 0]}))
    return records


class TreeTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path)  # a round's lines at once

    def write(self, rows: Sequence[Request], trace: Sequence[torch.Tensor]) -> None:
        self.out.write(*(record for _, record in tree_records(rows, trace)))

    def close(self) -> None:
        self.out.close()


class RecentTrees:
    """The last ``keep`` tree records of each request that keeps them (``Request.recent_trees`` not
    None), in memory."""

    def __init__(self, keep: int, then: TreeTracer | None = None):
        self.keep, self.then = keep, then  # ``then``: a trace file that gets every record too

    def write(self, rows: Sequence[Request], trace: Sequence[torch.Tensor]) -> None:
        if any(req.recent_trees is not None for req in rows):  # (else nothing to read: most rounds)
            for req, record in tree_records(rows, trace):
                if req.recent_trees is not None:
                    req.recent_trees.append(record)
                    del req.recent_trees[:-self.keep]
        if self.then is not None:
            self.then.write(rows, trace)

    def close(self) -> None:
        if self.then is not None:
            self.then.close()


class StepTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path, STEP_FLUSH_EVERY)
        self.start = time.perf_counter()

    def write(self, *, started: float, ended: float, previous_end: float | None, round_s: float | None,
              rows: int, nodes: int | None, prefill_s: float | None, prefill_rows: int) -> None:
        """One step, from ``perf_counter()`` times and durations in seconds."""
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        line = {"t": round(ended - self.start, 6), "gap_ms": ms(None if previous_end is None else started - previous_end),
                "round_ms": ms(round_s), "rows": rows, "nodes": nodes, "prefill_ms": ms(prefill_s),
                "prefill_rows": prefill_rows, "step_ms": ms(ended - started)}
        self.out.write(line)

    def close(self) -> None:
        self.out.close()


class PolicyTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path)  # a line at once
        self.start = time.perf_counter()

    def write(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None, policy: Policy,
              wall: float | None = None) -> None:
        """``seconds``: what the policy was fed (None: not timed, e.g. the round captured a CUDA
        graph or followed an idle pause); ``wall``: the round's wall time either way."""
        line = {"t": round(time.perf_counter() - self.start, 6), "rows": rows, "nodes": nodes,
                "ms": None if seconds is None else round(seconds * 1000, 4), "acceptance": acceptance,
                "wall_ms": None if wall is None else round(wall * 1000, 4)}
        estimates = policy.snapshot(rows)
        if estimates is not None:
            line["estimates"] = estimates
        self.out.write(line)

    def close(self) -> None:
        self.out.close()
