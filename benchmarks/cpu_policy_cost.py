"""The speculation policy's host time per round inside a running engine (``choose`` + ``record``).

On the H200, a DDTree-64 / DFlash engine whose drafter never matches spent 94 / 71 us of host time
per round in the policy (``gpu_plain_round_cost.py``, twelfth session), 1.2-1.7% of a 5.4 ms plain
round at Qwen3-8B shape: the device waits for it. A synthetic loop of the same calls takes a few
times less: inside an engine the interpreter runs with cold caches. This measures it where it
counts, inside an engine, without a GPU: a tiny random pair (its drafter never matches, so the
policy settles on plain rounds, as with random weights on the H200), 4 rows kept running. Each
engine runs twice: as on a CPU, and acting as on a device that runs ahead of the host
(``runner.runs_ahead``, as on CUDA), where the policy folds its held rounds while a round runs
(``fold_meanwhile_us_per_round``: host time the device does not wait for on a GPU; here, with
no device to run ahead, it is spent all the same).

    python benchmarks/cpu_policy_cost.py [--steps 4000] [--out FILE]

Run it on two checkouts to compare them (the numbers depend on the machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_plain_round_cost import policy_figures, time_policy  # noqa: E402

from flashtree import LLM, SamplingParams  # noqa: E402
from tests.dflash_helpers import tiny_pair  # noqa: E402


def policy_cost(pair, method: str, steps: int, warmup: int, runs_ahead: bool) -> dict:
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=16, max_running=8, max_context=512,
              adaptive_spec=True)
    engine = llm.engine
    engine.runner.runs_ahead = runs_ahead
    time_policy(engine)
    rng, live = random.Random(0), []
    for step in range(warmup + steps):
        live = [r for r in live if not r.finished]
        while len(live) < 4:
            prompt = [rng.randrange(3, 20) for _ in range(8)]
            live.append(engine.add_request(prompt, SamplingParams(max_tokens=300, ignore_eos=True)))
        engine.step()
        if step == warmup - 1:
            policy_figures(engine)  # (resets the sums)
    rounds = engine.policy_seconds[1]
    return {"method": method, "runs_ahead": runs_ahead, **policy_figures(engine), "rounds": rounds,
            "rounds_by_nodes": {str(k): v for k, v in engine.rounds_by_nodes.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="timed steps per engine (after 1,000 untimed)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest
    pair = tiny_pair(tempfile.mkdtemp(prefix="policy-cost-"), vocab=24, block_size=4)
    results = [policy_cost(pair, method, args.steps, warmup=1000, runs_ahead=ahead)
               for ahead in (False, True) for method in ("ddtree", "dflash")]
    for result in results:
        print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
                                        "torch": torch.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
