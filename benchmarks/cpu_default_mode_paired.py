"""CPU: flashtree's default mode (adaptive DDTree with the shipped drafter) against plain decoding of the
embedded SmolLM2, two engines in one process, the same prompts back to back.

    python benchmarks/cpu_default_mode_paired.py --repeats 2 --out benchmarks/results/cpu_default_mode_paired_epyc.json

Both engines are built and warmed first; then for every (repeat, prompt) one engine decodes the prompt and
the other right after (the order alternates), greedy, ``--new-tokens`` tokens, end of sequence ignored. The
tokens must be equal (lossless); reported: each run's decode tokens/s (after the first token), the tree
rounds the default mode ran, and the median of the default mode's rate over plain's per pair. Two runs a
few hundred milliseconds apart see the same machine, so on a machine whose speed drifts by 10-20% the
paired ratio is what a process-per-run comparison (cpu_default_mode.py, or cpu_vs_llamacpp.py
``decode_vs_flashtree_paired``)
cannot resolve; that one also counts what a fresh process costs (the policy's memory makes it probe trees
now and then: about one 4-round probe per 800 rounds).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from cpu_vs_llamacpp import PROMPTS, prompt_ids


def decode(engine, ids: list[int], new_tokens: int) -> dict:
    import flashtree

    req = engine.add_request(ids, flashtree.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    while not req.output_ids:
        engine.step()
    before = dict(engine.rounds_by_nodes)
    t0 = time.perf_counter()
    engine.run_until_done([req])
    seconds = time.perf_counter() - t0
    trees = sum(count - before.get(nodes, 0) for nodes, count in engine.rounds_by_nodes.items() if nodes)
    return {"tok_s": (len(req.output_ids) - 1) / seconds, "tokens": list(req.output_ids), "tree_rounds": trees}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    import flashtree

    torch.set_num_threads(args.threads)
    engines = {spec: flashtree.LLM("smollm2", spec=spec, device="cpu", max_running=1, max_context=1024).engine
               for spec in ("none", "ddtree")}
    for engine in engines.values():  # warm-up
        decode(engine, prompt_ids("smollm2", 0, 0)[:16], 8)
    runs, ratios = [], []
    for repeat in range(args.repeats):
        for prompt in range(len(PROMPTS)):
            ids = prompt_ids("smollm2", prompt, 0)
            order = ("none", "ddtree") if (prompt + repeat) % 2 == 0 else ("ddtree", "none")
            out = {spec: decode(engines[spec], ids, args.new_tokens) for spec in order}
            if out["none"]["tokens"] != out["ddtree"]["tokens"]:
                raise SystemExit(f"prompt {prompt}: the default mode's tokens differ from plain decoding's")
            ratios.append(out["ddtree"]["tok_s"] / out["none"]["tok_s"])
            runs.append({"prompt": prompt, "repeat": repeat, "plain_tok_s": round(out["none"]["tok_s"], 1),
                         "default_tok_s": round(out["ddtree"]["tok_s"], 1),
                         "default_tree_rounds": out["ddtree"]["tree_rounds"], "ratio": round(ratios[-1], 4)})
            print(runs[-1], flush=True)
    result = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "new_tokens": args.new_tokens, "median_ratio": statistics.median(ratios),
              "mean_ratio": statistics.mean(ratios), "runs": runs}
    print(f"default mode / plain, median of {len(ratios)} pairs: {result['median_ratio']:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
