"""H200: the DDTree tree kernels one by one, by warps per program.

    PYTHONPATH=. python benchmarks/gpu_tree_kernel_warps.py [--budgets 16,64,256] [--batches 1,8] [--out FILE]

Writes benchmarks/results/gpu_tree_kernel_warps.json by default (rename it by the device and the
date); the README's run went to results/tree_six_topk_and_served_paired_h200_2026-12-02/t/warps.json.

Vocab 151,936, 15 draft positions, bf16 logits, budgets 16 / 64 / 256, batch 1 and 8. Each part is
timed alone as one replayed CUDA graph (ms): the drafter's top-K tokens and log-probs
(``tree._top_tokens``: the Triton radix select of ``topk_kernels.top_log_probs``; for comparison,
torch.topk on the bf16 logits with the Triton log-normalizer (seventh session), and the torch ops
alone: float32 copy, logsumexp, top-k), ``tree_kernels.expand_levels``
and ``tree_kernels.select_nodes`` at 1, 2, 4 and 8 warps per program (outputs checked equal across
warps; select only where build_tree uses it, depth x budget <= tree.SELECT_KERNEL_MAX_NODES),
the kept lists' three threshold searches (sort of the prefilter list, bisection, a narrowed
bisection and a sort; each at its default warps, tree_kernels.EXPAND_WARPS; checked equal), and
``tree_kernels.accept_walk``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_build_speed import graphed_ms  # noqa: E402

from flashtree.kernels.gpu import topk as topk_kernels  # noqa: E402
from flashtree.kernels.gpu import tree as tree_kernels  # noqa: E402
from flashtree.speculative.tree import build as tree_module  # noqa: E402

WARPS = (1, 2, 4, 8)


def timed(fn, reps):
    return round(graphed_ms(fn, reps), 4)


def torch_top_tokens(logits, k):
    """The top-k log-probs as torch ops alone (the sixth session's ``tree._top_tokens``): a float32
    copy of the logits, logsumexp and top-k over it."""
    logits = logits.float()
    top = torch.topk(logits, k, dim=-1)
    return top.values - torch.logsumexp(logits, dim=-1, keepdim=True), top.indices


def topk_then_normalizer(logits, k):
    """The seventh session's ``tree._top_tokens``: torch.topk on the bf16 logits, then the Triton
    log-normalizer."""
    top = torch.topk(logits, k, dim=-1)
    return topk_kernels.log_normalize_top(logits, top.values), top.indices


def case(budget, batch, vocab, depth, reps, warps_list=WARPS):
    gen = torch.Generator().manual_seed(budget + batch)
    logits = (torch.randn(batch, depth, vocab, generator=gen) * 2).to("cuda", torch.bfloat16)
    budgets = torch.full((batch,), budget, device="cuda")
    k = min(budget, vocab)
    top_logp, top_tokens = tree_module._top_tokens(logits, k)
    pairs = tree_module._prefilter_pairs(budget, k, logits.device)
    row = {"budget": budget, "batch": batch, "prefilter_pairs": pairs[0].numel(),
           "top_tokens_ms": timed(lambda: tree_module._top_tokens(logits, k), reps),
           "top_tokens_topk_ms": timed(lambda: topk_then_normalizer(logits, k), reps),
           "top_tokens_torch_ms": timed(lambda: torch_top_tokens(logits, k), reps)}
    selects = depth * budget <= tree_module.SELECT_KERNEL_MAX_NODES
    levels, trees = [], []
    for warps in warps_list:
        levels.append(tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs, num_warps=warps))
        row[f"expand_w{warps}_ms"] = timed(
            lambda: tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs, num_warps=warps), reps)
        if selects:
            trees.append(tree_kernels.select_nodes(*levels[0], budgets, budget, num_warps=warps))
            row[f"select_w{warps}_ms"] = timed(
                lambda: tree_kernels.select_nodes(*levels[0], budgets, budget, num_warps=warps), reps)
    for search in tree_kernels.THRESHOLD_SEARCHES:
        levels.append(tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs, search=search))
        row[f"expand_{search}_ms"] = timed(
            lambda: tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs, search=search), reps)
    assert all(torch.equal(a, b) for lv in levels[1:] for a, b in zip(lv, levels[0])), "kept lists differ"
    assert all(torch.equal(a, b) for tr in trees[1:] for a, b in zip(tr, trees[0])), "select differs by warps"
    tree = tree_module.build_tree(logits, budgets, budget, kernel=True)
    choice = tree.tokens.roll(-1, dims=1)
    row["walk_ms"] = timed(lambda: tree_kernels.accept_walk(tree.tokens, tree.parents, tree.valid, choice, depth), reps)
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu_tree_kernel_warps.json")
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warps", default=",".join(map(str, WARPS)), help="warps per program to time")
    args = parser.parse_args()
    warps_list = tuple(map(int, args.warps.split(",")))
    rows = [case(b, n, 151_936, 15, args.reps, warps_list) for n in map(int, args.batches.split(","))
            for b in map(int, args.budgets.split(","))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    keys = (["top_tokens_ms", "top_tokens_topk_ms", "top_tokens_torch_ms"] + [f"expand_w{w}_ms" for w in warps_list]
            + [f"expand_{search}_ms" for search in tree_kernels.THRESHOLD_SEARCHES]
            + [f"select_w{w}_ms" for w in warps_list] + ["walk_ms"])
    print("budget batch " + " ".join(k.replace("_ms", "") for k in keys))
    for r in rows:
        print(f"{r['budget']:>6} {r['batch']:>5} " + " ".join(f"{r[k]:.4f}" if k in r else "-" for k in keys))


if __name__ == "__main__":
    main()
