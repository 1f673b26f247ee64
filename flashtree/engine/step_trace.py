"""Step traces (``--trace-steps FILE``): one short JSON line per engine step with where its time
went, so a server's wall time can be split into rounds, prefills, the rest of the step, and the
gap before it (the host outside the engine: HTTP work, the command queue, an idle engine).

Fields (ms, rounded to the microsecond): ``gap_ms`` since the previous step ended, ``round_ms``
(null when the step ran no round), ``prefill_ms`` (null without a prefill chunk), ``step_ms`` in
all; ``rows`` and ``nodes`` of the round, ``prefill_rows``. Every server writes the same lines
(plain ones too), so comparing servers compares like with like; lines are buffered and written
every ``FLUSH_EVERY`` steps and at exit, to keep the tracing itself cheap.
"""

from __future__ import annotations

import time
from pathlib import Path

from flashtree.engine.json_lines import JsonLines

FLUSH_EVERY = 512  # steps between writes


class StepTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path, FLUSH_EVERY)
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
