"""CPU, SmolLM2 (embedded Q4_1 + the shipped drafter), batch 1: what the default mode's engine costs per
plain step beyond the plain engine's, measured step by step in one process.

Engines, each with its own request for the same chat prompt, take one step each in turn (the order
rotates every step, so the machine's drifting speed hits them alike):
- ``plain``: the plain engine, and ``plain_twin``, a second one (an A/A check: how far two identical
  engines read apart here);
- ``ddtree_plain_rounds``: a DDTree engine pinned to plain rounds (``FixedNodes(0)``): the drafter's
  upkeep alone (feature sink, deferred context, catch-ups when the lag fills);
- ``ddtree``: the default mode's adaptive engine (its policy memory off, so it explores in the warm-up
  request; later rounds are plain unless a probe comes: its drafted rounds are counted).
Per engine against ``plain``: the total time of all decode steps (every step, catch-ups and probes
included), and the median of per-step time ratios over the steps in which every engine committed one
token. Tokens must equal plain's.

    python benchmarks/cpu_plain_steps_interleaved.py --repeats 3 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import PROMPTS  # noqa: E402

ENGINES = ("plain", "plain_twin", "ddtree_plain_rounds", "ddtree")


def make_engine(name: str):
    import flashtree
    from flashtree.policy import FixedNodes

    llm = flashtree.LLM("smollm2", spec="ddtree" if name.startswith("ddtree") else "none", device="cpu",
                        max_running=1)
    if name == "ddtree_plain_rounds":
        llm.engine.policy = FixedNodes(0)
    return llm


def start(llm, ids: list[int], new_tokens: int):
    import flashtree

    req = llm.engine.add_request(ids, flashtree.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    while not req.output_ids:  # (the prefill is not timed)
        llm.engine.step()
    return req


def run_prompt(llms: dict, ids: list[int], new_tokens: int, turn: int, totals: dict, ratios: dict) -> tuple[int, dict]:
    """Decode one prompt on every engine, a step each in turn; returns the turn counter and the tokens."""
    names = list(llms)
    reqs = {name: start(llm, ids, new_tokens) for name, llm in llms.items()}
    while any(len(r.output_ids) < new_tokens for r in reqs.values()):
        turn += 1
        step = {}
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            req = reqs[name]
            if len(req.output_ids) >= new_tokens:
                continue
            before, t0 = len(req.output_ids), time.perf_counter()
            llms[name].engine.step()
            step[name] = (time.perf_counter() - t0, len(req.output_ids) - before)
            totals[name] += step[name][0]
        if len(step) == len(names) and all(count == 1 for _, count in step.values()):
            for name in names[1:]:
                ratios[name].append(step[name][0] / step[names[0]][0])
    for name, llm in llms.items():
        llm.engine.run_until_done([reqs[name]])
    return turn, {name: r.output_ids[:new_tokens] for name, r in reqs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ["FLASHTREE_POLICY_CACHE"] = "off"
    torch.set_num_threads(args.threads)
    from flashtree.bench.environment import cpu_name
    from flashtree.models.tokenizer import encode_chat

    llms = {name: make_engine(name) for name in ENGINES}
    prompts = [encode_chat(llms["plain"].tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    for llm in llms.values():  # warm-up (the adaptive engine explores here)
        llm.engine.run_until_done([start(llm, prompts[0], 16)])
        llm.engine.rounds_by_nodes.clear()
    totals = dict.fromkeys(ENGINES, 0.0)
    ratios = {name: [] for name in ENGINES[1:]}
    turn, same_tokens = 0, True
    for _ in range(args.repeats):
        for ids in prompts:
            turn, tokens = run_prompt(llms, ids, args.new_tokens, turn, totals, ratios)
            same_tokens &= all(t == tokens["plain"] for t in tokens.values())
    summary = {name: {"total_s": totals[name], "total_vs_plain": totals[name] / totals["plain"],
                      "median_step_vs_plain": statistics.median(ratios[name]) if name in ratios else 1.0,
                      "drafted_rounds": sum(c for n, c in llms[name].engine.rounds_by_nodes.items() if n)}
               for name in ENGINES}
    out = {"cpu": cpu_name(), "threads": args.threads, "repeats": args.repeats, "prompts": len(prompts),
           "new_tokens": args.new_tokens, "same_tokens_as_plain": same_tokens, "summary": summary}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
