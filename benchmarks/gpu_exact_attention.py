"""H100 / H200: the exact mode's attention (kernels/gpu/exact_attention.py) against the fast tree attention, per
tile size, at the Qwen3-8B head layout (32 query heads, 8 kv heads, head dim 128, 16-entry pages).

    python benchmarks/gpu_exact_attention.py --out benchmarks/results/gpu_exact_attention_h100.json

For each batch size and forward (a plain step, a DFlash block of 16, DDTree trees of 16 and 64 nodes plus the
root: random trees, parents before children) over about ``--context`` committed entries per row (row lengths
differ, so tree keys straddle block boundaries), times one layer's attention: the fast kernel
(``tree_attention``, the new-token mask) and the exact kernel with every candidate of new tokens per program
(CUDA-event timing of launches after warm-up, median of ``--reps``), and checks that every candidate gives the
default candidate's output bit for bit. Prints one line per forward: microseconds per layer, and per round of
``--layers`` layers in milliseconds.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.attention import tree_attention  # noqa: E402
from flashtree.kernels.gpu import exact_attention as exact_module  # noqa: E402
from flashtree.kernels.gpu.exact_attention import ancestor_order, exact_attention, tokens_per_tile  # noqa: E402
from gpu_exact_gemm import timed_us  # noqa: E402  (benchmarks/ is the script's directory)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def random_tree_mask(nodes: int, gen: torch.Generator) -> torch.Tensor:
    """``[N, N]`` bool: node i sees itself and its ancestors; node i's parent is drawn among nodes 0 .. i-1,
    favouring recent ones (deep, narrow trees like DDTree's on a confident drafter)."""
    mask = torch.eye(nodes, dtype=torch.bool)
    for node in range(1, nodes):
        low = max(0, node - 4)
        parent = int(torch.randint(low, node, (1,), generator=gen))
        mask[node] |= mask[parent]
    return mask


def forward_inputs(batch: int, new: int, context: int, causal: bool, gen: torch.Generator):
    pages_per_slot = -(-(context + 64 + new) // PAGE)
    k_cache = torch.randn(batch * pages_per_slot, KV_HEADS, PAGE, HEAD_DIM, generator=gen).cuda().bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * pages_per_slot, generator=gen).view(batch, pages_per_slot).cuda()
    slots = torch.arange(batch, device="cuda")
    lengths = (context + torch.randint(0, 64, (batch,), generator=gen)).cuda()
    q = torch.randn(batch, HEADS, new, HEAD_DIM, generator=gen).cuda().bfloat16()
    if causal:
        mask = torch.ones(new, new, dtype=torch.bool).tril().expand(batch, new, new)
    else:
        mask = torch.stack([random_tree_mask(new, gen) for _ in range(batch)])
    return q, k_cache, v_cache, table, slots, lengths, mask.cuda().contiguous()


def measure(batch: int, name: str, new: int, causal: bool, context: int, layers: int, reps: int,
            candidates: list[tuple[int, bool | None]]) -> dict:
    gen = torch.Generator().manual_seed(batch * 1000 + new)
    q, k_cache, v_cache, table, slots, lengths, mask = forward_inputs(batch, new, context, causal, gen)
    order = None if causal or new == 1 else ancestor_order(mask)
    fast_us = timed_us(lambda: tree_attention(q, k_cache, v_cache, table, slots, lengths, mask), reps)
    reference = exact_attention(q, k_cache, v_cache, table, slots, lengths, order)
    row = {"batch": batch, "forward": name, "new_tokens": new, "fast_us": fast_us,
           "default_tokens": tokens_per_tile(new, 4, causal), "candidates": []}
    for tokens, parallel in candidates:
        out = exact_attention(q, k_cache, v_cache, table, slots, lengths, order, parallel=parallel, tokens=tokens)
        us = timed_us(lambda: exact_attention(q, k_cache, v_cache, table, slots, lengths, order,  # noqa: B023
                                              parallel=parallel, tokens=tokens), reps)
        row["candidates"].append({"tokens": tokens, "parallel": parallel, "us": us,
                                  "equals_default": torch.equal(out, reference)})
    best = min((c for c in row["candidates"] if c["equals_default"]), key=lambda c: c["us"], default=None)
    row["best"] = best
    print(f"b={batch:3d} {name:9s} fast {fast_us:7.1f} us ({fast_us * layers / 1000:5.2f} ms/{layers} layers)  "
          f"exact (tokens/placement: us, same bits as the default) "
          + " ".join(f"{c['tokens']}/{str(c['parallel'])[0]}:{c['us']:.0f},{'=' if c['equals_default'] else 'DIFF'}"
                     for c in row["candidates"]), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--forwards", default="plain,dflash16,ddtree16,ddtree64")
    parser.add_argument("--tokens", default="4,8,16,32", help="new tokens per program to try")
    parser.add_argument("--parallel", default="auto,split,one", help="split placements to try (auto: the default)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--block-n", type=int, default=None,
                        help="logical keys per block (exact_attention.BLOCK_N: other bits than the default's; every "
                             "candidate is then checked against this block size's default tile)")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (exact_attention.STAGES)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.block_n:
        exact_module.BLOCK_N = args.block_n
    if args.stages:
        exact_module.STAGES = args.stages
    forwards = {"plain": (1, True), "dflash16": (16, True), "ddtree16": (17, False), "ddtree64": (65, False)}
    candidates = [(int(t), {"auto": None, "split": True, "one": False}[p])
                  for t in args.tokens.split(",") for p in args.parallel.split(",")]
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in map(int, args.batches.split(",")):
        for name in args.forwards.split(","):
            rows.append(measure(batch, name, *forwards[name], args.context, args.layers, args.reps, candidates))
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "context": args.context,
                                            "block_n": exact_module.BLOCK_N, "stages": exact_module.STAGES,
                                            "rows": rows}, indent=1))  # after each row: a cut-off run keeps its rows


if __name__ == "__main__":
    main()
