"""CPU: a verification forward of SmolLM2 (the embedded GGUF, int8 activations, C++ kernels) with its tree
attended by the C++ kernel, which every verification forward now takes (a node must get plain decoding's
bits), against SDPA's blocked kernel, which served trees of more than 32 tokens before; and whether each
way gives the root the plain step's logits bit for bit.

    python benchmarks/cpu_wide_tree_attention.py --out benchmarks/results/cpu_wide_tree_attention_epyc_2026-12-06.json

Per tree width (nodes + 1 tokens) and context length: the median time of ``--repeats`` forwards each way,
alternating, on one random tree over a prompt of random tokens.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree import LLM
from flashtree.kernels.cpu import fused
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from tests.helpers import random_tree

KERNEL_ROUTE = fused.handles_attention


def sdpa_route(new_tokens: int, prefill: bool = False) -> bool:  # the routing before: SDPA past 32 tokens
    return new_tokens <= 32


def measure(model, context: int, tokens: int, repeats: int) -> dict:
    cfg = model.config
    spec = KVCacheSpec(cfg.num_hidden_layers, 1, context + tokens + 16, 256, cfg.num_key_value_heads, cfg.head_dim)
    cache, slot = KVCache(spec, torch.float32, torch.device("cpu")), torch.tensor([0])
    gen = torch.Generator().manual_seed(context + tokens)
    prompt = torch.randint(100, 20000, (1, context), generator=gen)
    model(ForwardBatch(prompt, torch.arange(context)[None], slot, torch.tensor([0]),
                       causal_mask(torch.tensor([context]), context), kv_len=context, prefill=True), cache)
    cache.advance(slot, torch.tensor([context]))
    mask, depth = random_tree(tokens, gen)
    ids = torch.randint(100, 20000, (1, tokens), generator=gen)
    tree = ForwardBatch(ids, context + depth[None], slot, torch.tensor([context]), mask, kv_len=context + tokens)
    step = ForwardBatch(ids[:, :1], torch.tensor([[context]]), slot, torch.tensor([context]),
                        torch.ones(1, 1, 1, dtype=torch.bool), kv_len=context + 1)
    times, same = {"kernel": [], "sdpa": []}, {}
    for name, route in (("kernel", KERNEL_ROUTE), ("sdpa", sdpa_route)):
        fused.handles_attention = route
        same[name] = torch.equal(model(step, cache).logits[0, 0], model(tree, cache).logits[0, 0])
    for _ in range(repeats):
        for name, route in (("kernel", KERNEL_ROUTE), ("sdpa", sdpa_route)):
            fused.handles_attention = route
            start = time.perf_counter()
            model(tree, cache)
            times[name].append(time.perf_counter() - start)
    fused.handles_attention = KERNEL_ROUTE
    row = {"context": context, "tree_tokens": tokens, "kernel_ms": statistics.median(times["kernel"]) * 1e3,
           "sdpa_ms": statistics.median(times["sdpa"]) * 1e3, "root_equals_plain_step": same}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--tokens", default="17,33,65,129")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = LLM("smollm2", device="cpu", max_running=1, max_context=64).engine.model
    rows = [measure(model, c, t, args.repeats) for c in map(int, args.contexts.split(","))
            for t in map(int, args.tokens.split(","))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": platform.processor() or platform.machine(),
                                          "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
