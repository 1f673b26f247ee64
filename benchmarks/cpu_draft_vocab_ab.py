"""CPU A/B of the draft vocabulary (``--draft-vocab N``, speculative/draft_vocab.py): plain decoding and
DDTree (fixed budget) with the whole vocabulary and with the N most frequent tokens, on the embedded
default (SmolLM2 + the shipped drafter, fp32, batch 1, greedy, end of sequence ignored).

The systems alternate prompt by prompt and repeat by repeat (this VM's speed drifts by tens of
percent), every system's tokens must equal plain decoding's, and each reports tokens/s (generation
wall time, prefill included) and tau.

    python benchmarks/cpu_draft_vocab_ab.py [--sizes 16384,24576] [--budget 4] [--dataset sharegpt-heldout|humaneval]
        [--prompts 8] [--out FILE]

Writes results/cpu_draft_vocab_ab.json by default (rename it by what it measured and the date); the
committed runs are results/cpu_draft_vocab_ab_epyc_2026-12-03.json (``--dataset humaneval``:
results/cpu_draft_vocab_ab_humaneval_epyc_2026-12-03.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import flashtree
from flashtree import SamplingParams
from flashtree.bench.datasets import load_prompts
from flashtree.bench.environment import environment

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_draft_vocab_ab.json"


def load_systems(sizes: list[int], budget: int) -> dict:
    options = dict(device="cpu", dtype="float32", max_running=1, max_context=2048)
    systems = {"plain": flashtree.LLM("smollm2", **options)}
    for size in [None, *sizes]:
        name = f"ddtree:{budget}" + ("" if size is None else f" vocab {size}")
        systems[name] = flashtree.LLM("smollm2", spec="ddtree", budget=budget, adaptive_spec=False,
                                      draft_vocab=size, **options)
    return systems


def run(llm, prompt_ids: list[int], new_tokens: int):
    start = time.perf_counter()
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
    return out.token_ids, list(out.acceptance_lengths), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16384,24576")
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--dataset", default="sharegpt-heldout", help="a flashtree bench dataset")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems = load_systems([int(s) for s in args.sizes.split(",")], args.budget)
    plain = systems["plain"]
    prompts = [p.encode(plain.tokenizer) for p in load_prompts(args.dataset, args.prompts)]
    for llm in systems.values():  # warm-up, untimed
        run(llm, prompts[0], 8)
    seconds = {name: 0.0 for name in systems}
    accepted = {name: [] for name in systems}
    per_repeat = {name: [] for name in systems}
    exact = {name: True for name in systems}
    for repeat in range(args.repeats):
        repeat_seconds = {name: 0.0 for name in systems}
        for index, prompt_ids in enumerate(prompts):
            order = list(systems)[index % len(systems):] + list(systems)[:index % len(systems)]
            tokens = {}
            for name in order:
                tokens[name], lengths, wall = run(systems[name], prompt_ids, args.new_tokens)
                repeat_seconds[name] += wall
                if repeat == 0:
                    accepted[name] += lengths
            for name in systems:
                exact[name] &= tokens[name] == tokens["plain"]
        for name in systems:
            seconds[name] += repeat_seconds[name]
            per_repeat[name].append(len(prompts) * args.new_tokens / repeat_seconds[name])
        print(f"repeat {repeat}: " + ", ".join(f"{n} {per_repeat[n][-1]:.1f} tok/s" for n in systems), flush=True)
    rows = []
    for name in systems:
        rate = args.repeats * len(prompts) * args.new_tokens / seconds[name]
        ratios = [r / p for r, p in zip(per_repeat[name], per_repeat["plain"])]
        rows.append({"system": name, "tokens_per_s": round(rate, 2), "tau": round(statistics.mean(accepted[name]), 3)
                     if accepted[name] else 1.0, "rounds": len(accepted[name]), "exact": exact[name],
                     "speedup_per_repeat": [round(x, 3) for x in ratios]})
        print(json.dumps(rows[-1]), flush=True)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "budget": args.budget, "dataset": args.dataset,
           "prompts": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
