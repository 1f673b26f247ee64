"""Policy traces (``--trace-policy FILE``): one JSON line per batched round with what the adaptive
speculation policy chose and measured, and its estimates afterwards, so a run's choices can be
explained (which option looked fastest, from which measurements). Writing is host-only work after
the round's sync; it does not change what runs on the device.
"""

from __future__ import annotations

import time
from pathlib import Path

from flashtree.engine.json_lines import JsonLines


class PolicyTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path)  # a line at once
        self.start = time.perf_counter()

    def write(self, rows: int, nodes: int, seconds: float | None, acceptance: float | None, policy,
              wall: float | None = None) -> None:
        """``seconds``: what the policy was fed (None: not timed, e.g. the round captured a CUDA
        graph or followed an idle pause); ``wall``: the round's wall time either way."""
        line = {"t": round(time.perf_counter() - self.start, 6), "rows": rows, "nodes": nodes,
                "ms": None if seconds is None else round(seconds * 1000, 4), "acceptance": acceptance,
                "wall_ms": None if wall is None else round(wall * 1000, 4)}
        snapshot = getattr(policy, "snapshot", None)
        if snapshot is not None:
            line["estimates"] = snapshot(rows)
        self.out.write(line)

    def close(self) -> None:
        self.out.close()
