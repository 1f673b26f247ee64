"""Tokens and acceptance lengths of every decoding mode on the real SmolLM2 pair, as a JSON snapshot.

Two snapshots of the same machine and dtype are compared with ``--compare OLD.json``: a change of
structure must leave every token id and every acceptance length as it was. It runs through the
public API only (``flashtree.LLM``), so the same script runs on any version of the package.

    python benchmarks/token_snapshot.py --out before.json            # CPU, fp32
    python benchmarks/token_snapshot.py --out after.json --compare before.json
    python benchmarks/token_snapshot.py --device cuda --out h200.json  # bf16 on CUDA

Modes: plain, DFlash, DDTree at fixed budgets, and the command line's default (DDTree with the
shipped drafter, adaptive), each at one row and at four rows together, greedy and seeded sampling.
The adaptive policy picks node counts from measured round times, so two runs of the default mode may
verify different trees: ``--compare`` checks its tokens only, and every other mode's acceptance too.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from flashtree import LLM, SamplingParams

# name -> LLM keyword arguments
MODES = {
    "plain": dict(spec="none"),
    "dflash": dict(spec="dflash", adaptive_spec=False),
    "ddtree4": dict(spec="ddtree", budget=4, adaptive_spec=False),
    "ddtree16": dict(spec="ddtree", budget=16, adaptive_spec=False),
    "default": dict(spec="ddtree"),  # the command line's default: adaptive DDTree with the shipped drafter
}
TIMED = {"default"}  # modes whose node counts follow measured round times
PROMPTS = (
    "Write a haiku about trees.",
    "Explain what a hash table is in two sentences.",
    "def fibonacci(n):",
    "List three uses of a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Give me a short motivational quote.",
)


def snapshot(device: str | None, dtype: str | None, max_tokens: int, modes: list[str]) -> dict:
    results: dict[str, dict] = {}
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    for name in modes:
        llm = LLM("smollm2", device=device, dtype=dtype, max_running=4, **MODES[name])
        for label, params in (("greedy", SamplingParams(max_tokens=max_tokens)),
                              ("sampled", SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=7))):
            one_row = [llm.chat(conv, params)[0] for conv in messages]  # one request at a time
            batched = llm.chat(messages, params)  # four rows at once (max_running=4)
            for rows, outs in (("rows1", one_row), ("rows4", batched)):
                results[f"{name}/{label}/{rows}"] = {
                    "token_ids": [o.token_ids for o in outs],
                    "acceptance_lengths": [o.acceptance_lengths for o in outs]}
        print(f"{name}: done", file=sys.stderr, flush=True)
    return results


def compare(new: dict, old: dict) -> list[str]:
    """Lines naming every run whose tokens or acceptance lengths differ."""
    problems = []
    for key in sorted(set(new) | set(old)):
        if key not in new or key not in old:
            problems.append(f"{key}: only in {'new' if key in new else 'old'}")
            continue
        fields = ("token_ids",) if key.split("/")[0] in TIMED else ("token_ids", "acceptance_lengths")
        for field in fields:
            for i, (a, b) in enumerate(zip(new[key][field], old[key][field])):
                if a != b:
                    problems.append(f"{key}: prompt {i} {field} differ")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default=None, help="auto (default), cpu, cuda")
    parser.add_argument("--dtype", default=None, help="auto (default: bf16 on CUDA, fp32 on CPU), float32, ...")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--compare", default=None, metavar="OLD.json", help="a snapshot to compare with")
    args = parser.parse_args()
    started = time.perf_counter()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} unknown; allowed: {', '.join(MODES)}")
    runs = snapshot(args.device, args.dtype, args.max_tokens, modes)
    record = {"machine": platform.processor() or platform.machine(), "device": args.device or "auto",
              "dtype": args.dtype or "auto",
              "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - started, 1), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)["runs"]
        problems = compare(runs, {k: v for k, v in old.items() if k.split("/")[0] in modes})
        print("\n".join(problems) if problems else f"identical: {len(runs)} runs")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
