"""Trace files: JSON lines that observe the engine and never change what it runs.

- ``--trace-trees FILE`` (:class:`TreeTracer`): one line per request per round with the verified tree
  (node tokens and parents, root first) and the accepted path (node indices, root first). The round
  returns its tree tensors beside its result (inside its CUDA graph too), and the host writes them
  after the round's one sync.
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


class TreeTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path)  # a round's lines at once

    def write(self, rows: Sequence[Request], trace: Sequence[torch.Tensor]) -> None:
        """One line per row of a round whose results the host has read: ``trace`` = (tokens, parents,
        valid ``[B, N]``, path ``[B, P]``) on the host, pad rows after the real ones. A row that
        finished after the round was queued gets none: its result is dropped."""
        tokens, parents, valid, path = (t.tolist() for t in trace)
        lines = []
        for b, req in enumerate(rows):
            if req.finished:
                continue
            count = sum(valid[b])  # valid nodes are a leading run: root, then drafted nodes
            lines.append({"request_id": req.request_id, "round": req.stats.rounds, "tokens": tokens[b][:count],
                          "parents": parents[b][:count], "accepted_path": [n for n in path[b] if n >= 0]})
        self.out.write(*lines)

    def close(self) -> None:
        self.out.close()


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
