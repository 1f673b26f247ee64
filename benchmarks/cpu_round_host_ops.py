"""CPU: the accept walk and the KV commit of a DDTree round, on the host against the torch ops.

On a CPU both are a couple of dozen small torch ops whatever the tree's size; ``accept_walk``
now walks with numpy (``spec/verify_host.py``) and ``KVCache.commit`` moves only the entries that
change place, row by row (``_commit_moves_on_host``). This times each pair, the two ways
alternating (median of ``--repeats`` blocks), on trees built from random logits at SmolLM2's
vocabulary and KV shape (30 layers, 3 KV heads x 64, fp32), with target choices that follow the
tree for a few steps, as an accepting round's do.

    python benchmarks/cpu_round_host_ops.py [--repeats 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashtree.bench.environment import environment
from flashtree.kv_cache import KVCache, KVCacheSpec
from flashtree.spec.tree import build_tree
from flashtree.spec.verify import accept_walk

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_round_host_ops.json"
CASES = ((1, 4), (4, 4), (1, 16), (8, 8), (32, 4))  # (rows, budget)
VOCAB, MAX_DEPTH = 49_152, 7


def round_inputs(rows: int, budget: int, generator: torch.Generator):
    depth = min(budget, MAX_DEPTH)
    logits = torch.randn(rows, depth, VOCAB, generator=generator) * 3
    tree = build_tree(logits, budget, budget, host=True)
    choice = torch.randint(0, VOCAB, (rows, budget + 1), generator=generator)
    for r in range(rows):  # follow the first child twice: paths of 2-3 nodes
        node = 0
        for _ in range(2):
            kids = [k for k in range(1, budget + 1) if tree.valid[r, k] and tree.parents[r, k] == node]
            if not kids:
                break
            choice[r, node] = tree.tokens[r, kids[0]]
            node = kids[0]
    return tree, choice, depth


def median_us(fn, calls: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(rows: int, budget: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows * 100 + budget)
    tree, choice, depth = round_inputs(rows, budget, generator)
    walks = [accept_walk(tree, choice, depth, host=host) for host in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*walks)), "the host walk differs from the torch ops"
    walk = walks[1]
    cache = KVCache(KVCacheSpec(num_layers=30, max_slots=rows + 1, max_context=512, scratch=budget + 1,
                                kv_heads=3, head_dim=64), torch.float32, "cpu")
    slots, starts = torch.arange(rows), torch.full((rows,), 300)
    path = walk.path.clamp(min=0)
    samples = {"walk_torch": [], "walk_host": [], "commit_batched": [], "commit_host": []}
    for _ in range(repeats):
        samples["walk_torch"].append(median_us(lambda: accept_walk(tree, choice, depth, host=False)))
        samples["walk_host"].append(median_us(lambda: accept_walk(tree, choice, depth, host=True)))
        samples["commit_batched"].append(median_us(lambda: cache._commit_moves_batched(slots, starts, path)))
        samples["commit_host"].append(median_us(lambda: cache._commit_moves_on_host(slots, starts, path)))
    row = {"rows": rows, "budget": budget, "mean_accept_length": round(walk.accept_lengths.float().mean().item(), 2)}
    row.update({f"{name}_us": round(statistics.median(values), 1) for name, values in samples.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for num_rows, budget in CASES:
        rows.append(measure(num_rows, budget, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
