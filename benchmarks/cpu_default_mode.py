"""CPU: the default mode (adaptive DDTree with the shipped drafter) against plain decoding, each
prompt in a fresh process as ``flashtree generate`` runs it, with and without the policy's memory
(``flashtree/policy/memory.py``).

Systems, taking turns prompt by prompt (the starting system rotates, so background load hits them
alike): ``plain`` (``--spec none``), ``default`` (the memory on, in a directory of this run's: the
first default process of the run explores, the later ones start from what the earlier ones learned)
and ``default_no_memory`` (``FLASHTREE_POLICY_CACHE=off``: every process explores). Each worker runs
what ``benchmarks/cpu_vs_llamacpp.py`` runs (the chat template's prompt ids, a 4-token warm-up
request, then ``--new-tokens`` greedy tokens, end of sequence ignored, ``--threads`` threads) and
reports decode tokens/s (also per second of the process's CPU time: steadier than wall time while
other processes load the cores, and close to it at one thread) and its rounds by node count. Per
system: the median decode tokens/s, the median of its per-prompt ratios to plain (same prompt, same
repeat), its tree rounds, and whether its tokens equal plain's (they must: every mode is lossless).

Workloads: ``chat`` (cpu_vs_llamacpp.py's 8 prompts: the shipped drafter is weak on them, plain
should win) and ``counting`` (prompts the drafter predicts well, acceptance about 4.5 of 5 with
DDTree-4: the default mode must move to trees and beat plain).

    python benchmarks/cpu_default_mode.py --workload chat --repeats 2 --out FILE.json
    python benchmarks/cpu_default_mode.py --workload counting --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import PROMPTS as CHAT_PROMPTS  # noqa: E402

COUNTING_PROMPTS = ["Count from 1 to 100, separated by commas.", "List the numbers from 1 to 50, one per line.",
                    "Count from 200 to 260, separated by commas.",
                    "Write the even numbers from 2 to 120, separated by commas."]
WORKLOADS = {"chat": CHAT_PROMPTS, "counting": COUNTING_PROMPTS}
SYSTEMS = ("plain", "default", "default_no_memory")


def run_worker(prompt: str, system: str, new_tokens: int, threads: int) -> dict:
    import torch

    import flashtree
    from flashtree.models.tokenizer import encode_chat

    torch.set_num_threads(threads)
    llm = flashtree.LLM("smollm2", spec="none" if system == "plain" else "ddtree", device="cpu", max_running=1)
    engine = llm.engine
    ids = encode_chat(llm.tokenizer, [{"role": "user", "content": prompt}])
    warm = engine.add_request(ids[:8], flashtree.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run_until_done([warm])
    engine.rounds_by_nodes.clear()
    req = engine.add_request(ids, flashtree.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    while not req.output_ids:
        engine.step()
    t1, c1 = time.perf_counter(), time.process_time()
    engine.run_until_done([req])
    decode_s, decode_cpu_s = time.perf_counter() - t1, time.process_time() - c1
    return {"tokens": req.output_ids, "decode_tok_s": (len(req.output_ids) - 1) / decode_s,
            "decode_tok_per_cpu_s": (len(req.output_ids) - 1) / decode_cpu_s,
            "rounds_by_nodes": {str(n): c for n, c in sorted(engine.rounds_by_nodes.items())}}


def run_system(args, prompt: int, system: str, memory_dir: str) -> dict:
    env = {**os.environ, "FLASHTREE_POLICY_CACHE": "off" if system == "default_no_memory" else memory_dir}
    command = [sys.executable, __file__, "--worker", system, "--prompt", str(prompt), "--workload", args.workload,
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], systems: tuple[str, ...]) -> dict:
    plain = {(r["prompt"], r["repeat"]): r for r in runs if r["system"] == "plain"}
    summary = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        summary[system] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
            "decode_tok_per_cpu_s": statistics.median(r["decode_tok_per_cpu_s"] for r in mine),
            "tree_rounds": [sum(c for n, c in r["rounds_by_nodes"].items() if n != "0") for r in mine],
            "rounds": [sum(r["rounds_by_nodes"].values()) for r in mine]}
        if plain:
            ratios = [r["decode_tok_s"] / plain[(r["prompt"], r["repeat"])]["decode_tok_s"] for r in mine]
            cpu_ratios = [r["decode_tok_per_cpu_s"] / plain[(r["prompt"], r["repeat"])]["decode_tok_per_cpu_s"]
                          for r in mine]
            summary[system].update(
                vs_plain_median_of_ratios=statistics.median(ratios),
                cpu_time_vs_plain_median_of_ratios=statistics.median(cpu_ratios),
                vs_plain_of_medians=summary[system]["decode_tok_s"] / statistics.median(
                    p["decode_tok_s"] for p in plain.values()),
                same_tokens_as_plain=all(r["tokens"] == plain[(r["prompt"], r["repeat"])]["tokens"] for r in mine))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    parser.add_argument("--memory-dir", help="the default system's policy memory (default: a fresh temporary "
                                             "directory, so the run's first default process explores)")
    parser.add_argument("--out")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompts = WORKLOADS[args.workload]
    if args.worker:
        print(json.dumps(run_worker(prompts[args.prompt], args.worker, args.new_tokens, args.threads)))
        return
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    memory_dir = args.memory_dir or tempfile.mkdtemp(prefix="flashtree-policy-memory-")
    runs = []
    for repeat in range(args.repeats):
        for prompt in range(len(prompts)):
            turn = (prompt + repeat) % len(systems)
            for system in systems[turn:] + systems[:turn]:
                runs.append({"system": system, "prompt": prompt, "repeat": repeat,
                             **run_system(args, prompt, system, memory_dir)})
                shown = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in runs[-1].items() if k != "tokens"}
                print(shown, flush=True)
    summary = summarize(runs, systems)
    out = {"cpu": platform.processor() or platform.machine(), "workload": args.workload, "threads": args.threads,
           "new_tokens": args.new_tokens, "memory_dir": memory_dir, "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
