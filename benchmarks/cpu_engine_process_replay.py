"""What one engine-process iteration costs the server process, per streamed token (CPU, no GPU needed).

With ``flashtree serve --engine-process`` the server's reader thread unpickles each driver iteration's
messages, hands the deltas to the streams' event loop and replays the step's metric calls on the server's
``ServerMetrics``; that thread shares the server's interpreter lock with the event loop. This script builds
the messages of a plain step of ``--rows`` streaming requests (one token each) exactly as the engine
process's outbox does, then times the reader's work on them (no process, no pipe: only the Python work).
It also reports the engine process's side (recording and pickling the same messages).

    python benchmarks/cpu_engine_process_replay.py [--rows 64] [--iterations 300] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.bench.report import write_json  # noqa: E402
from flashtree.server.async_engine import AsyncEngine  # noqa: E402
from flashtree.server.engine_process import EngineProcess, PipeOutbox  # noqa: E402
from flashtree.server.metrics import ServerMetrics, StepFigures  # noqa: E402
from flashtree.server.stream import GenerationDelta, RequestStream  # noqa: E402


class Captured:
    """Stands in for the pipe: keeps what the outbox sends, pickled as the pipe would."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, messages) -> None:
        self.sent.append(pickle.dumps(messages))


def plain_step(outbox: PipeOutbox, keys: list[int]) -> None:
    """One driver iteration of a plain step, one token per row, as EngineDriver reports it."""
    rows = len(keys)
    outbox.deliver([(key, GenerationDelta((1234,), " hello", None)) for key in keys])
    outbox.metrics.observe_step(StepFigures(round_nodes=0, generated=rows, inter_token=[(0.004, 1)] * rows,
                                            acceptance_lengths=[1] * rows, tree_sizes=[0] * rows), 0)
    outbox.metrics.set_load(running=rows, waiting=0, used_pages=100, pages=1000, replica=0)
    outbox.metrics.set_graphs(0, 0, replica=0)
    outbox.flush()


def measure(rows: int, iterations: int) -> dict:
    loop = asyncio.new_event_loop()
    runner = EngineProcess(config=None)
    front = AsyncEngine(runner, ServerMetrics())
    streams = [RequestStream(loop) for _ in range(rows)]
    for stream in streams:
        runner._streams[stream.key] = stream
    pipe = Captured()
    outbox = PipeOutbox(pipe)
    start = time.perf_counter()
    for _ in range(iterations):
        plain_step(outbox, [s.key for s in streams])
    engine_side = time.perf_counter() - start
    start = time.perf_counter()
    for data in pipe.sent:
        for message in pickle.loads(data):
            runner._dispatch(front, *message)
    server_side = time.perf_counter() - start
    loop.close()  # (the posted deliveries are dropped)
    tokens = rows * iterations
    return {"server_us_per_token": 1e6 * server_side / tokens, "engine_us_per_token": 1e6 * engine_side / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [measure(args.rows, args.iterations) for _ in range(args.repeats)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = {"command": " ".join(sys.argv), "commit": commit, "rows": args.rows, "iterations": args.iterations,
              "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "runs": runs, **{f"median_{k}": statistics.median(r[k] for r in runs) for k in runs[0]}}
    print(json.dumps(result))
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()
