"""CPU: ms per DDTree build, the host path (numpy after the top-k, ``speculative/tree/host.py``) against
the torch ops (``build_tree(..., host=False)``), by rows and budget; both give the same tree.

Drafter logits are random float32 at SmolLM2's vocabulary (49,152) and the shipped drafter's depth
(block 8: 7 positions; a tree of n nodes needs min(n, 7) of them, as ``DDTreeProposer`` asks).
Median of ``--reps`` builds after 3 warm-up builds, the two paths in alternation. The crossover
sets ``tree.HOST_MAX_BUDGET`` and ``tree.HOST_MAX_ROW_NODES``.

    python benchmarks/cpu_tree_host.py [--rows 1,4,16,32] [--budgets 2,4,8,16,32,64] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashtree.bench.environment import cpu_name
from flashtree.speculative.tree.build import HOST_MAX_BUDGET, HOST_MAX_ROW_NODES, build_tree

VOCAB, MAX_DEPTH = 49152, 7


def build_ms(logits: torch.Tensor, budget: int, host: bool) -> float:
    t0 = time.perf_counter()
    build_tree(logits, budget, budget, host=host)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--budgets", default="2,4,8,16,32,64")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = []
    print("| rows | budget | host ms | torch ops ms | torch / host |\n| --- | --- | --- | --- | --- |")
    for rows in map(int, args.rows.split(",")):
        for budget in map(int, args.budgets.split(",")):
            logits = torch.randn(rows, min(budget, MAX_DEPTH), VOCAB, generator=torch.Generator().manual_seed(rows))
            times: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.reps + 3):
                for host in (True, False):
                    ms = build_ms(logits, budget, host)
                    if rep >= 3:
                        times[host].append(ms)
            host_ms, torch_ms = statistics.median(times[True]), statistics.median(times[False])
            results.append({"rows": rows, "budget": budget, "host_ms": round(host_ms, 4), "torch_ms": round(torch_ms, 4)})
            print(f"| {rows} | {budget} | {host_ms:.3f} | {torch_ms:.3f} | {torch_ms / host_ms:.2f} |", flush=True)
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "vocab": VOCAB,
              "max_depth": MAX_DEPTH, "reps": args.reps, "host_max_budget": HOST_MAX_BUDGET,
              "host_max_row_nodes": HOST_MAX_ROW_NODES, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
