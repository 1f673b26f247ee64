"""CPU: garbage-collection pauses inside a serving process, with and without freezing the startup
objects (``ServerConfig.freeze_gc``, what ``flashtree serve`` does after loading).

The server (SmolLM2 + the shipped drafter, DDTree, as ``flashtree serve`` runs it with no model
flags) runs in this process, so every collection in it is recorded (``gc.callbacks``: generation
and duration); the load comes from ``load_test.py`` in a subprocess (streamed chat requests through
the official openai client). Passes alternate unfrozen / frozen (``gc.unfreeze()`` before an
unfrozen one). Also timed: one explicit full collection right after each server's start.

Why: in the H200 step traces every server, plain included, had about one 40-110 ms round per
4-5 s pass at 16-32 rows (benchmarks/journal/session-11-2026-12-02.md); a full collection walks
every tracked object of the process.

    python benchmarks/cpu_gc_pauses.py [--passes 4] [--concurrency 16] [--requests 32] [--max-tokens 64] [--out FILE]

Writes results/cpu_gc_pauses.json by default (rename it by what it measured and the date); the
committed run is results/cpu_gc_pauses_2026-12-02.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.server.config import ServerConfig  # noqa: E402
from flashtree.speculative.defaults import shipped_drafter  # noqa: E402
from tests.support.server import ServerThread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_gc_pauses.json"


class CollectionLog:
    """Every collection while active: (generation, ms)."""

    def __init__(self):
        self.events: list[tuple[int, float]] = []
        self._started = 0.0
        self.active = False

    def __call__(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.events.append((info["generation"], (time.perf_counter() - self._started) * 1000))

    def summary(self) -> dict:
        out = {}
        for gen in (0, 1, 2):
            times = [ms for g, ms in self.events if g == gen]
            out[f"gen{gen}"] = {"count": len(times), "total_ms": round(sum(times), 1),
                                "max_ms": round(max(times), 2) if times else 0.0}
        return out


def one_pass(config: ServerConfig, freeze: bool, args, log: CollectionLog) -> dict:
    if not freeze:
        gc.unfreeze()
    with ServerThread(dataclasses.replace(config, freeze_gc=freeze)) as server:
        start = time.perf_counter()
        gc.collect()
        full_ms = (time.perf_counter() - start) * 1000
        tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
        log.events.clear()
        log.active = True
        load = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "load_test.py"), "--base-url", f"{server.url}/v1",
             "--model", config.model_name, "--concurrency", str(args.concurrency), "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--ignore-eos", "--out", str(Path(args.scratch) / "load")],
            capture_output=True, text=True, timeout=1800)
        log.active = False
        if load.returncode != 0:
            raise RuntimeError(load.stderr[-2000:])
    return {"freeze": freeze, "tracked_objects": tracked, "frozen_objects": frozen,
            "explicit_full_collection_ms": round(full_ms, 1), "collections": log.summary(),
            "load_tail": load.stdout.strip().splitlines()[-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--scratch", default="/tmp/flashtree-gc-pauses")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    spec = SpeculationConfig(method="ddtree", draft=str(shipped_drafter("smollm2")))
    engine = EngineConfig.of(spec=spec, model="smollm2", device="cpu", max_running=args.concurrency, max_context=1024)
    config = ServerConfig(engine=engine, model_name="smollm2", port=0, log_level="warning")
    log = CollectionLog()
    gc.callbacks.append(log)
    passes = []
    for index in range(args.passes):
        passes.append(one_pass(config, freeze=index % 2 == 1, args=args, log=log))
        print(json.dumps(passes[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "python": sys.version.split()[0],
                                    "passes": passes}, indent=1) + "\n")


if __name__ == "__main__":
    main()
