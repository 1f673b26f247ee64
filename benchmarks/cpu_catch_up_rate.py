"""CPU, tiny random pair: how often a DDTree engine on plain rounds runs a drafter catch-up (an eager
drafter pass over the deferred context features) under request churn, per round.

A server at concurrency C keeps C requests in flight: each finished request is replaced at once
(prompts of 20-40 tokens, 128 new tokens), so rows join at different times. The engine runs plain
rounds only (a drafter that never matches). Counts are deterministic; times are not reported (the
cost of one catch-up on the H200 is what matters, and a CPU says nothing about it).

    python benchmarks/cpu_catch_up_rate.py [--rows 4,16,32] [--steps 1500] [--out FILE]

Writes results/cpu_catch_up_rate.json by default (rename it by what it measured and the date); the
committed runs are results/cpu_catch_up_rate_after_2026-12-02.json and ``..._before_2026-12-02.json``
(before catch-ups in one pass, journal/session-10-2026-12-02.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.policy import FixedNodes  # noqa: E402
from tests.dflash_helpers import tiny_pair  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_catch_up_rate.json"


def catch_ups_per_round(pair, rows: int, steps: int, seed: int = 0) -> dict:
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=16, max_running=max(32, rows),
              max_context=512, prefill_chunk=256)
    engine = llm.engine
    engine.policy = FixedNodes(0)  # plain rounds only
    passes = []  # rows of each catch-up pass
    real = engine.proposer.catch_up_rows  # the drafter pass (eager on a CPU: no pad rows)
    engine.proposer.catch_up_rows = lambda slots, starts, counts, width: (passes.append(len(slots)),
                                                                          real(slots, starts, counts, width))
    rng = random.Random(seed)

    def new_request():
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(20, 40))]
        return engine.add_request(prompt, SamplingParams(max_tokens=128, ignore_eos=True))

    live = [new_request() for _ in range(rows)]
    for _ in range(steps):
        engine.step()
        live = [new_request() if r.finished else r for r in live]
    rounds = sum(engine.rounds_by_nodes.values())
    return {"rows": rows, "rounds": rounds, "catch_ups": len(passes),
            "catch_ups_per_round": round(len(passes) / rounds, 4),
            "mean_rows_per_catch_up": round(sum(passes) / max(1, len(passes)), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,16,32")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = tiny_pair(Path(tempfile.mkdtemp()), vocab=512, block_size=8)
    results = [catch_ups_per_round(pair, int(r), args.steps) for r in args.rows.split(",")]
    for r in results:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
