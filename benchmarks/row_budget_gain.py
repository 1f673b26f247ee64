"""Per-row budgets at equal verified tokens: how many more tokens a round commits when each row's
nodes come from its own tree (``policy/row_budgets.allot_budgets``, ragged layout) than when every
row verifies the same number of nodes, on real prompts with the real pair.

One engine decodes ``--rows`` prompts together with DDTree at ``--budget`` nodes per row (fixed,
greedy, eager: no CUDA graphs, so the round's Python runs every time) and records every round's trees
and the target's choice at every node (the accept walk's inputs). Then, for each round and each
total of verified tokens ``T = rows x (1 + n)`` (``n`` from ``--per-row``), it walks each row's
tree cut to (a) its best ``n`` nodes (uniform) and (b) the allotment's budgets filling ``T`` (a cost
curve flat up to ``T``, closed after it). The target's choice at a node depends only on the node's
own path, which every cut that keeps the node keeps too, so one verify serves every cut. Reported
per total: mean tokens committed per row and round (bonus included) both ways, what the drafter's
path probabilities expected of each, and the ratio. ``--time-build`` also times the tree build with
and without the allotment on the device (random logits, Triton kernels where they run).

    python benchmarks/row_budget_gain.py --device cpu --rows 8 --budget 32 --spans 2,4 --out /tmp/gain.json
    python benchmarks/row_budget_gain.py --device cuda --dataset humaneval --rows 16 --budget 64 \\
        --time-build --out benchmarks/results/row_budget_gain_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def record_rounds(args) -> list[tuple[torch.Tensor, ...]]:
    """Decode the prompts; every round's tree fields (DraftTree's order), the target's choices and
    the walk's depth, on the CPU."""
    import flashtree.engine.round as round_module
    from flashtree import LLM, SamplingParams
    from flashtree.bench.datasets import load_prompts

    llm = LLM(args.model, spec="ddtree", draft=args.draft, budget=args.budget, adaptive_spec=False,
              max_running=args.rows, max_context=args.max_context, device=args.device, cuda_graphs=False)
    prompts = [p.encode(llm.tokenizer) for p in load_prompts(args.dataset, args.rows)]
    rounds, real_walk = [], round_module.accept_walk

    def recording_walk(tree, choice, max_depth=None, **options):
        rounds.append(tuple(t.detach().cpu() for t in tree) + (choice.detach().cpu(), max_depth))
        return real_walk(tree, choice, max_depth, **options)

    round_module.accept_walk = recording_walk
    try:
        llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
    finally:
        round_module.accept_walk = real_walk
    return rounds


def ranked(log_weights: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's drafted nodes by the build's rank order (weight descending; ties: shallower, then
    earlier on the node axis, which the layout already orders): node ranks [R, N] (the root -1,
    padding N) and the ranked log-weights [R, N - 1]."""
    weights = torch.where(valid, log_weights, float("-inf"))[:, 1:].double()  # [R, N - 1]
    order = torch.sort(-weights, dim=1, stable=True).indices  # [R, N - 1]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    rank = torch.where(valid[:, 1:], rank, order.shape[1])
    root = torch.full_like(rank[:, :1], -1)
    return torch.cat([root, rank], 1), weights.gather(1, order).float()


def committed(record, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens committed per row [R] (bonus included) when each row keeps its best ``budgets[r]``
    nodes, and what the path probabilities expected of that cut [R]."""
    from flashtree.speculative.tree import DraftTree
    from flashtree.speculative.verify import accept_walk

    *fields, choice, max_depth = record
    tree = DraftTree(*fields)
    rank, weights = ranked(tree.log_weights, tree.valid)
    kept = tree.valid & (rank < budgets[:, None])  # [R, N]; the root's rank is -1
    walk = accept_walk(tree._replace(valid=kept), choice, max_depth)
    width = torch.arange(weights.shape[1])
    expected = 1.0 + torch.where(width[None, :] < budgets[:, None], weights.exp(), 0.0).sum(1)
    return walk.accept_lengths.float(), expected


def compare(rounds, per_row: list[int], budget: int, spans: list[int] = ()) -> list[dict]:
    """Per total: tau of the uniform cut and of the allotment from each row's whole tree (``allotted``) and, for
    each span s, from trees cut to ``s x n`` nodes (``allotted_span_s``: the packed rounds' trees, runner.py)."""
    from flashtree.policy.row_budgets import allot_budgets

    rows_out = []
    for n in per_row:
        caps_by_name = {"allotted": budget} | {f"allotted_span_{s}": min(budget, s * n) for s in spans}
        sums = {f"{name}{part}": 0.0 for name in ("uniform", *caps_by_name) for part in ("", "_expected")}
        row_rounds = 0
        for record in rounds:
            valid, log_weights = record[3], record[5]
            rows = valid.shape[0]
            _, weights = ranked(log_weights, valid)
            cost = torch.ones(rows * (1 + n) + 1)  # flat up to the total, closed after it
            cuts = {"uniform": torch.full((rows,), n)}
            for name, cap in caps_by_name.items():
                caps = torch.full((rows,), cap, dtype=torch.long)
                cuts[name] = allot_budgets(weights, caps, cost, torch.ones(rows, dtype=torch.bool))
            for name, budgets in cuts.items():
                got, expected = committed(record, budgets)
                sums[name] += got.sum().item()
                sums[f"{name}_expected"] += expected.sum().item()
            row_rounds += rows
        out = {"nodes_per_row": n, "row_rounds": row_rounds} | {k: v / max(row_rounds, 1) for k, v in sums.items()}
        for name in caps_by_name:
            out[f"{name}_over_uniform"] = out[name] / max(out["uniform"], 1e-9)
        rows_out.append(out)
    return rows_out


def time_build(device: str, rows_list: list[int], budgets: list[int], vocab: int, depth: int) -> list[dict]:
    """Seconds of build_tree (Triton kernels where they run) with and without the allotment."""
    from flashtree.policy.row_budgets import allot_budgets
    from flashtree.speculative.tree import build_tree

    results = []
    for rows in rows_list:
        for budget in budgets:
            logits = torch.randn(rows, depth, vocab, device=device) * 3
            cost = torch.ones(rows * (budget + 1) + 1, device=device)
            live = torch.ones(rows, dtype=torch.bool, device=device)
            rule = lambda ranked, caps: allot_budgets(ranked, caps, cost, live)  # noqa: E731
            row = {"rows": rows, "budget": budget}
            for name, allot in (("plain_ms", None), ("allotted_ms", rule)):
                run = lambda: build_tree(logits, budget, budget, kernel=True, allot=allot)  # noqa: E731
                for _ in range(3):
                    run()
                if device == "cuda":
                    torch.cuda.synchronize()
                start, reps = time.perf_counter(), 20
                for _ in range(reps):
                    run()
                if device == "cuda":
                    torch.cuda.synchronize()
                row[name] = (time.perf_counter() - start) / reps * 1000
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft", default=None, help="drafter (default: the model's shipped one)")
    parser.add_argument("--dataset", default="sharegpt-heldout")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--per-row", default="1,2,4,8,16", help="uniform nodes per row of each total compared")
    parser.add_argument("--spans", default="", help="also allot from trees cut to span x n nodes, e.g. 2,4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--time-build", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_row = [n for n in map(int, args.per_row.split(",")) if n <= args.budget]
    rounds = record_rounds(args)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": len(rounds),
              "by_total": compare(rounds, per_row, args.budget, [int(s) for s in filter(None, args.spans.split(","))])}
    if args.time_build:
        result["build"] = time_build(args.device, [1, 8, 16, 32], [16, 64], 49152, 15)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(rounds)} rounds of {args.rows} rows, DDTree-{args.budget}, {args.dataset}")
    print("| nodes per row | uniform tau | allotted tau | allotted / uniform | expected uniform | expected allotted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["by_total"]:
        print(f"| {r['nodes_per_row']} | {r['uniform']:.3f} | {r['allotted']:.3f} | {r['allotted_over_uniform']:.3f} "
              f"| {r['uniform_expected']:.3f} | {r['allotted_expected']:.3f} |")
        spans = [k for k in r if k.startswith("allotted_span_") and not k.endswith(("_expected", "_over_uniform"))]
        if spans:
            print("    " + ", ".join(f"{k[len('allotted_'):]}: {r[k]:.3f} ({r[k + '_over_uniform']:.3f}x)" for k in spans))
    for b in result.get("build", []):
        print(f"build rows {b['rows']} budget {b['budget']}: {b['plain_ms']:.3f} ms, "
              f"with allotment {b['allotted_ms']:.3f} ms")


if __name__ == "__main__":
    main()
