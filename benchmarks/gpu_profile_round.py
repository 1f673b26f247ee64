"""H200: kernel-time breakdown (torch.profiler) of one plain decode step and of the DDTree tree
work (build + walk + commit) at Qwen3-8B shape. Guides optimization; prints two tables.

    python benchmarks/gpu_profile_round.py
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_rounds import start_requests  # noqa: E402
from qwen3_8b_shape import QWEN3_8B, write_config  # noqa: E402

from flashtree.config import EngineConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.kv.cache import KVCache, KVCacheSpec  # noqa: E402
from flashtree.speculative.tree import build_tree  # noqa: E402
from flashtree.speculative.verify import accept_walk  # noqa: E402


def table(prof, n=25):
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60)


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    target = write_config("/tmp/flashtree-qwen3-8b", QWEN3_8B)
    engine = LLMEngine(EngineConfig.of(model=str(target), random_weights=True, device="cuda", max_running=1,
                                       max_context=2048, cuda_graphs=False))
    start_requests(engine, 1, 1024)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print("=== plain decode step, batch 1, 5 steps ===")
    print(table(prof))
    del engine
    torch.cuda.empty_cache()
    budget, batch = 256, 1
    logits = torch.randn(batch, 15, QWEN3_8B["vocab_size"], device="cuda", dtype=torch.bfloat16)
    cache = KVCache(KVCacheSpec(36, batch, 2048, budget + 1, 8, 128), torch.bfloat16, "cuda")
    slots, starts = torch.arange(batch, device="cuda"), torch.full((batch,), 1024, device="cuda")
    budgets = torch.full((batch,), budget, device="cuda")
    for _ in range(2):
        tree = build_tree(logits, budgets, budget)
        walk = accept_walk(tree, tree.tokens.roll(-1, 1), 15)
        cache.commit(slots, starts, walk.path.clamp(min=0), walk.accept_lengths)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tree = build_tree(logits, budgets, budget)
            walk = accept_walk(tree, tree.tokens.roll(-1, 1), 15)
            cache.commit(slots, starts, walk.path.clamp(min=0), walk.accept_lengths)
        torch.cuda.synchronize()
    print("=== tree work, budget 256, batch 1, 5 rounds ===")
    print(table(prof, 30))


if __name__ == "__main__":
    main()
