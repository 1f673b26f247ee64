"""H200: where the time goes inside the two big DDTree tree kernels, stage by stage.

    PYTHONPATH=. python benchmarks/gpu_tree_kernel_stages.py [--budgets 64,256,1024] [--out FILE]

Writes benchmarks/results/gpu_tree_kernel_stages.json by default (rename it by the device and the
date); the README's run went to results/tree_commit_lengths_five_topk_h200_2026-12-02/c2/stages.json.

Vocab 151,936, 15 draft positions, bf16 logits (randn x 2), batch 1, budgets 64 / 256 / 1024.
``tree_kernels.expand_levels`` and ``select_nodes`` run with ``stage_clocks``: each program reads
the SM cycle counter between stages (the kernels' CLOCKS option; the stages are named in
``flashtree/kernels/gpu/triton_tree.py``) and writes the cycles per stage. Each kernel is also timed alone as one
replayed CUDA graph without clocks (``kernel_ms``); a stage's ``us`` is its share of the clocked
cycles times that time (the clocks themselves cost a little; their total is ``clocked_cycles``).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_build_speed import graphed_ms  # noqa: E402

from flashtree.kernels.gpu import tree as tree_kernels  # noqa: E402
from flashtree.speculative.tree import build as tree_module  # noqa: E402

STAGES = {
    "expand": ["sort kept weights + lower bound", "candidates", "threshold", "counts", "slot owners",
               "new weights + stores", "-", "-"],
    "select": ["loads + lower bound", "threshold", "compaction", "rank sort", "layout + parents",
               "ancestors", "barrier", "mask ones"],
}


def stage_table(name, run, kernel_ms):
    clocks = torch.zeros(1, 8, dtype=torch.long, device="cuda")
    for _ in range(3):  # compile, then keep the last run's clocks
        clocks.zero_()
        run(clocks)
    torch.cuda.synchronize()
    cycles = clocks[0].tolist()
    total = sum(cycles)
    return {"kernel_ms": kernel_ms, "clocked_cycles": total,
            "stages": {label: {"cycles": c, "share": round(c / total, 4), "us": round(1000 * kernel_ms * c / total, 2)}
                       for label, c in zip(STAGES[name], cycles) if label != "-"}}


def case(budget, reps, vocab=151_936, depth=15):
    gen = torch.Generator().manual_seed(budget)
    logits = (torch.randn(1, depth, vocab, generator=gen) * 2).to("cuda", torch.bfloat16)
    budgets = torch.full((1,), budget, device="cuda")
    k = min(budget, vocab)
    top_logp, top_tokens = tree_module._top_tokens(logits, k)
    pairs = tree_module._prefilter_pairs(budget, k, logits.device)
    levels = tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs)
    expand_ms = round(graphed_ms(lambda: tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs), reps), 4)
    row = {"budget": budget, "batch": 1, "search": tree_kernels.threshold_search(pairs[0].numel(), budget),
           "expand": stage_table("expand", lambda c: tree_kernels.expand_levels(
               top_logp, top_tokens, budget, *pairs, stage_clocks=c), expand_ms)}
    if depth * budget <= tree_module.SELECT_KERNEL_MAX_NODES:
        select_ms = round(graphed_ms(lambda: tree_kernels.select_nodes(*levels, budgets, budget), reps), 4)
        row["select"] = stage_table("select", lambda c: tree_kernels.select_nodes(
            *levels, budgets, budget, stage_clocks=c), select_ms)
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu_tree_kernel_stages.json")
    parser.add_argument("--budgets", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    rows = [case(b, args.reps) for b in map(int, args.budgets.split(","))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    for r in rows:
        for name in ("expand", "select"):
            if name in r:
                parts = ", ".join(f"{label} {v['us']}" for label, v in r[name]["stages"].items())
                print(f"budget {r['budget']} {name} {r[name]['kernel_ms']} ms: {parts}")


if __name__ == "__main__":
    main()
