"""The Triton tree kernels (kept lists, node selection, accept walk, KV commit) against the torch and
host paths when the rows of a round keep different numbers of nodes: each row's budget chosen by a
rule from its ranked path weights (rows at 0, at 1, at the full count, and the policy's allotment in
both layouts). Counts of differences, 0 expected. Run as
``python -m tests.support.row_budget_kernel_checks`` under ``TRITON_INTERPRET=1`` on CPU tensors
(tests/integration/test_row_budget_kernels.py), or in-process on CUDA (tests/gpu/test_row_budget_kernels.py);
prints one JSON line."""

from __future__ import annotations

import json
import random

import torch

from flashtree.policy.row_budgets import allot_budgets
from flashtree.speculative.tree import build as tree_module
from flashtree.speculative.verify import accept_walk
from tests.support.kernel_checks import walk_choices
from tests.support.tree_reference import make_logits


def rules(rows: int, budget: int, rng: random.Random, device: str) -> dict:
    """Name -> allot rule: fixed budgets 0, 1, full, and random ones; the policy's allotment over a
    random ridge-shaped cost curve, ragged and padded."""
    fixed = torch.tensor([[0, 1, budget][r % 3] if r < 3 else rng.randint(0, budget) for r in range(rows)],
                         device=device)
    tokens = rows * (budget + 1)
    ridge, slope = rng.randint(rows, tokens), rng.random() * 0.2
    cost = 1.0 + slope * (torch.arange(tokens + 1, device=device, dtype=torch.float32) - ridge).clamp(min=0)
    live = torch.ones(rows, dtype=torch.bool, device=device)
    live[-1] = rows < 4  # a pad row when there are several
    return {"fixed": lambda ranked, caps: torch.minimum(fixed, caps),
            "ragged": lambda ranked, caps: allot_budgets(ranked, caps, cost, live),
            "padded": lambda ranked, caps: allot_budgets(ranked, caps, cost, live, padded=True)}


def compare_trees(device: str, cases: int) -> dict[str, float]:
    rng = random.Random(0)
    differing = {"trees_kernel_vs_torch": 0, "trees_host_vs_torch": 0, "walks": 0, "commits": 0, "mixed_rounds": 0}
    for case in range(cases):
        kind = ("f32", "int6", "int2")[case % 3]
        depth, vocab, rows = rng.randint(1, 6), rng.randint(5, 120), rng.choice([1, 3, 5])
        budget = rng.choice([1, 4, depth, 16, 40])
        logits = make_logits(kind, rows, depth, vocab, case).to(device)
        caps = torch.tensor([rng.choice([budget, budget, rng.randint(0, budget)]) for _ in range(rows)], device=device)
        for name, rule in rules(rows, budget, rng, device).items():
            torch_tree = tree_module.build_tree(logits, caps, budget, host=False, allot=rule)
            kernel_tree = tree_module.build_tree(logits, caps, budget, kernel=True, host=False, allot=rule)
            differing["trees_kernel_vs_torch"] += not same(kernel_tree, torch_tree)
            if device == "cpu":
                host_tree = tree_module.build_tree(logits, caps, budget, host=True, allot=rule)
                differing["trees_host_vs_torch"] += not same(host_tree, torch_tree)
            sizes = (torch_tree.valid.sum(1) - 1).tolist()
            differing["mixed_rounds"] += len(set(sizes)) > 1
            for seed in range(2):
                choice = walk_choices(torch_tree, seed)
                walks = [accept_walk(torch_tree, choice, depth, kernel=kernel) for kernel in (True, False)]
                differing["walks"] += any(not torch.equal(a, b) for a, b in zip(*walks))
                differing["commits"] += not same_commits(walks[1], rows, depth, device, case)
    out = {f"row_budgets/differing_{k}": float(v) for k, v in differing.items() if k != "mixed_rounds"}
    out["row_budgets/rounds_with_mixed_sizes"] = float(differing["mixed_rounds"])
    return out


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def same_commits(walk, rows: int, depth: int, device: str, seed: int) -> bool:
    """The accepted paths committed by the commit kernel and by the torch gather: same storage and lengths."""
    from flashtree.kv.cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=2, max_slots=rows + 1, max_context=16, scratch=48, kv_heads=2, head_dim=8)
    caches = [KVCache(spec, torch.float32, device) for _ in range(2)]
    values = torch.randn(caches[0].storage.shape, generator=torch.Generator().manual_seed(seed))
    starts = torch.arange(rows, device=device) % 5
    slots = torch.arange(rows, device=device)
    caches[1].commit_kernel = True
    for cache in caches:
        cache.storage.copy_(values)
        cache.commit(slots, starts, walk.path.clamp(min=0), walk.accept_lengths)
    return torch.equal(caches[0].storage, caches[1].storage) and torch.equal(caches[0].lengths, caches[1].lengths)


if __name__ == "__main__":  # under TRITON_INTERPRET=1
    print(json.dumps(compare_trees("cpu", cases=18)))
