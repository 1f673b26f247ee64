"""The first timed pass after start-up against the second, and CUDA-graph captures in each (issue #39).

    python benchmarks/gpu_first_pass.py --out benchmarks/results/gpu_first_pass_h200.json

One engine per method (plain, DFlash, DDTree at fixed budgets, the adaptive default) on the
Qwen3-8B shape with random bf16 weights (the drafter at z-lab's Qwen3-8B-DFlash-b16 shape: it never
matches, so this measures what graphs and rounds cost, not acceptance). Per batch size, two passes
of the same prompts on that engine: tokens/s, and the graphs captured inside each timed pass
(``torch.cuda.CUDAGraph.capture_begin`` counted). A gap between the passes is work done while
serving, which the user pays for.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config  # noqa: E402

from flashtree import LLM, SamplingParams  # noqa: E402

captures = 0
_capture_begin = torch.cuda.CUDAGraph.capture_begin


def _counting_capture_begin(self, *args, **kwargs):
    global captures
    captures += 1
    return _capture_begin(self, *args, **kwargs)


torch.cuda.CUDAGraph.capture_begin = _counting_capture_begin


def method_engine(method: str, target: Path, drafter: Path, max_running: int, max_context: int) -> LLM:
    """``none``, ``dflash``, ``ddtree:N`` (a fixed budget) or ``adaptive`` (DDTree, the policy's choice)."""
    common = dict(random_weights=True, max_running=max_running, max_context=max_context)
    if method == "none":
        return LLM(str(target), **common)
    if method == "dflash":
        return LLM(str(target), spec="dflash", draft=str(drafter), adaptive_spec=False, **common)
    if method == "adaptive":
        return LLM(str(target), spec="ddtree", draft=str(drafter), **common)
    budget = int(method.split(":")[1])
    return LLM(str(target), spec="ddtree", draft=str(drafter), budget=budget, adaptive_spec=False, **common)


def timed_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    global captures
    before = captures
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "captures": captures - before,
            "tokens": [o.token_ids for o in outs]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="none,dflash,ddtree:16,ddtree:64,adaptive")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    work = Path(tempfile.mkdtemp())
    target = write_config(work / "target", QWEN3_8B)
    drafter = write_config(work / "drafter", QWEN3_8B_DFLASH)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (args.prompt_tokens,), generator=gen).tolist() for _ in range(max(batches))]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    report = {"device": torch.cuda.get_device_name(), "shape": "qwen3-8b (random bf16)", "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "rows": []}
    print(f"{'method':>10} {'batch':>5} {'pass1 tok/s':>12} {'pass2 tok/s':>12} {'1/2':>6} {'captures 1, 2':>14} "
          f"{'start-up s':>10}", flush=True)
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        start_captures = captures
        llm = method_engine(method, target, drafter, max(batches), args.prompt_tokens + args.new_tokens + 64)
        startup = time.perf_counter() - t0
        startup_captures = captures - start_captures
        for batch in batches:
            first = timed_pass(llm, prompts[:batch], params)
            second = timed_pass(llm, prompts[:batch], params)
            row = {"method": method, "batch": batch, "startup_s": startup, "startup_captures": startup_captures,
                   "pass1_tok_s": first["tok_s"], "pass2_tok_s": second["tok_s"],
                   "pass1_captures": first["captures"], "pass2_captures": second["captures"],
                   "same_tokens": first["tokens"] == second["tokens"]}
            report["rows"].append(row)
            print(f"{method:>10} {batch:>5} {first['tok_s']:>12.1f} {second['tok_s']:>12.1f} "
                  f"{first['tok_s'] / second['tok_s']:>6.2f} {first['captures']:>6}, {second['captures']:<6} "
                  f"{startup:>10.1f}", flush=True)
        del llm
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
