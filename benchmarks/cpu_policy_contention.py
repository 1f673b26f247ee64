"""CPU, SmolLM2 + the shipped drafter, DDTree (adaptive), 32 rows decoded together: what a burst of
other work on the machine does to the speculation policy's choice (issue #5, sixteenth session).

On a 2-core CPU a tree-4 round of 32 rows costs about 4.4 plain rounds, so the policy settles on
plain rounds there. A paired served load test once ran a dozen tree rounds per 32-row pass
(0.71-0.80 of plain's throughput): slow plain rounds during other work could lift plain's
estimate above the tree's quiet one. Here each run decodes ``--rows`` chats of ``--new-tokens``
tokens after a warm-up that settles the 32-row bucket; in the "burst" runs ``--burners``
busy-looping processes run for ``--burst-s`` seconds, starting ``--burst-at-s`` into the decode.
Reports per run the wall time and the rounds per node count (tree rounds beyond the quiet run's
are the burst's doing). The tokens are plain decoding's either way (checked).

    python benchmarks/cpu_policy_contention.py [--runs 2] [--out FILE]

Writes results/cpu_policy_contention.json by default (rename it by what it measured and the date);
the committed run is results/cpu_policy_contention_epyc_2026-12-02/cpu_policy_contention_with_pace.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
from pathlib import Path

from flashtree import LLM, SamplingParams
from flashtree.bench.environment import cpu_name
from flashtree.models.tokenizer import encode_chat

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_policy_contention.json"
TOPICS = ["hash maps", "binary search", "TCP handshakes", "garbage collection", "B-trees", "HTTP caching",
          "unit tests", "public-key crypto", "SQL joins", "virtual memory", "compilers", "DNS",
          "rainbows", "volcanoes", "photosynthesis", "tides", "the French revolution", "jazz", "chess openings",
          "bread baking", "black holes", "vaccines", "glaciers", "bees", "the Roman roads", "solar panels",
          "coffee roasting", "earthquakes", "the printing press", "penguins", "electric motors", "origami"]


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def prompts(llm: LLM, rows: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in a few paragraphs."}]
             for i in range(rows)]
    return [encode_chat(llm.tokenizer, c) for c in chats]


def one_run(llm: LLM, ids, params, burst: tuple[int, float, float] | None) -> dict:
    burners: list[multiprocessing.Process] = []
    timer = None
    if burst is not None:
        count, at_s, for_s = burst

        def start():
            for _ in range(count):
                burners.append(multiprocessing.Process(target=burn, args=(for_s,)))
                burners[-1].start()

        timer = threading.Timer(at_s, start)
        timer.start()
    llm.stats(reset=True)
    start_t = time.perf_counter()
    outs = llm.generate(ids, params)
    wall = time.perf_counter() - start_t
    if timer is not None:
        timer.join()
    for p in burners:
        p.join()
    return {"wall_s": round(wall, 3), "rounds_by_nodes": llm.stats().rounds_by_nodes,
            "estimates_after": llm.engine.policy.snapshot(len(ids)), "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2, help="quiet / burst pairs")
    ap.add_argument("--burners", type=int, default=4)
    ap.add_argument("--burst-at-s", type=float, default=2.0)
    ap.add_argument("--burst-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    plain = LLM("smollm2", spec="none", max_running=args.rows, max_context=512)
    llm = LLM("smollm2", spec="ddtree", max_running=args.rows, max_context=512, adaptive_spec=True)
    ids = prompts(llm, args.rows)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(ids, params)]
    llm.generate(ids, SamplingParams(max_tokens=48, ignore_eos=True))  # warm-up: explores and settles
    runs = []
    for i in range(args.runs):
        for kind in ("quiet", "burst"):
            burst = (args.burners, args.burst_at_s, args.burst_s) if kind == "burst" else None
            run = one_run(llm, ids, params, burst)
            exact = run.pop("tokens") == expected
            runs.append({"kind": kind, "exact": exact, **run})
            print(json.dumps(runs[-1]), flush=True)
    report = {"machine": cpu_name(), "command": "python benchmarks/cpu_policy_contention.py " +
              " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
