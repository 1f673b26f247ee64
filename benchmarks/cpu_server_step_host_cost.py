"""Host time of the server's engine thread per request per step, outside the engine's round: the
committed tokens appended (stop checks, incremental text with the SmolLM2 tokenizer) and
``EngineDriver._step``'s work (deltas, metrics, handing the deltas to the event loop).

On the H200 a served round is followed by 0.25 ms (1 row) to 1.4 ms (32 rows) of host time before the
next one (benchmarks/journal/session-10-2026-12-02.md); this is the per-request part of it, measured on
this machine's CPU with a stand-in engine whose ``step()`` returns the appended tokens' events.

    python benchmarks/cpu_server_step_host_cost.py [--rows 32] [--steps 300] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.bench.report import write_json  # noqa: E402
from flashtree.engine.output import TextTracker, append_tokens  # noqa: E402
from flashtree.engine.request import Request  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402
from flashtree.server.async_engine import AsyncEngine, EngineThread  # noqa: E402
from flashtree.server.engine_driver import EngineDriver, Inbox, _Tracked  # noqa: E402
from flashtree.server.metrics import ServerMetrics  # noqa: E402
from flashtree.server.stream import RequestStream  # noqa: E402



class StandInEngine:
    """``step()`` appends one token to every row (as a plain round does) and returns the events."""

    last_round_nodes = 0

    def __init__(self, rows: int, tokenizer, seed: int = 0):
        self.tracker = TextTracker(tokenizer, incremental=True)
        self.rng = random.Random(seed)
        self.rows = [Request(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=10**9, ignore_eos=True),
                             stop_token_ids=frozenset()) for _ in range(rows)]

    def step(self):
        events = []
        for req in self.rows:
            token = self.rng.randrange(200, 40000)
            req.stats.rounds += 1
            req.stats.acceptance_lengths.append(1)
            req.stats.tree_sizes.append(0)
            events.append(append_tokens(req, [token], self.tracker, 10**9))
        return events


def per_request_us(rows: int, steps: int, tokenizer) -> float:
    engine = StandInEngine(rows, tokenizer)
    metrics = ServerMetrics()
    server = EngineDriver(lambda: engine, metrics, Inbox(), AsyncEngine(EngineThread(lambda: engine), metrics))
    server.engine = engine
    loop = asyncio.new_event_loop()
    for req in engine.rows:
        server._tracked[req.request_id] = _Tracked(req, RequestStream(loop), time.monotonic())
    for _ in range(20):
        server._step()
    start = time.perf_counter()
    for _ in range(steps):
        server._step()
    seconds = time.perf_counter() - start
    loop.close()  # (the queued deliveries are dropped)
    return seconds / steps / rows * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded SmolLM2's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from flashtree.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_dir("smollm2"))
    runs = [per_request_us(args.rows, args.steps, tokenizer) for _ in range(args.repeats)]
    result = {"rows": args.rows, "steps": args.steps, "us_per_request_per_step_runs": [round(r, 2) for r in runs],
              "median_us": round(statistics.median(runs), 2), "cpu": platform.processor() or platform.machine(),
              "python": platform.python_version()}
    print(json.dumps(result))
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()
