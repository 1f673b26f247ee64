"""H200: masked SDPA (cuDNN, additive bias) by query count, with and without padding the
queries (and the bias rows) to a multiple of a query tile, and without a mask.

Why: gpu_round_anatomy.py measured 36 layers of 257 queries over 1,281 keys with a bias at
2.32 ms against 1.31 ms for 256 queries over 1,280 keys. This script separates the query count
from the key count. Result (results/gpu_attention_padding_h200.json): with the engine's key
counts (multiples of 256) the unpadded bias is the fastest at every query count, so the engine
does not pad; the anatomy's slow case was the unaligned key count.

    PYTHONPATH=. python benchmarks/gpu_attention_padding.py --out benchmarks/results/gpu_attention_padding_h200.json

Qwen3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), 36 layers per replay (one
forward's worth), a committed context of ``--context`` tokens followed by the N new tokens with a
causal mask among them (the cost does not depend on the mask's pattern), keys up to the engine's
256-token bucket. Each figure is one CUDA-graph replay of the 36 layers, ms.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_build_speed import graphed_ms  # noqa: E402

from flashtree.models import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 36


def layers_ms(q, keys, values, bias, reps):
    """36 layers of the engine's masked attention; a bias with more rows than q pads q to match."""
    n = q.shape[2]
    padded_q = F.pad(q, (0, 0, 0, bias.shape[2] - n))

    def run():
        for _ in range(LAYERS):
            attention.masked_attention(padded_q if bias.shape[2] > n else q, keys, values, bias)[:, :, :n]
    return graphed_ms(run, reps)


def padded_bias(mask, dtype, tile):
    """The additive bias with rows padded to a multiple of ``tile`` (padded rows see every key)."""
    n = mask.shape[2]
    rows = n if n == 1 else -(-n // tile) * tile
    bias = torch.zeros(*mask.shape[:2], rows, mask.shape[3], dtype=dtype, device=mask.device)
    bias[:, :, :n] = attention.attention_bias(mask, dtype)
    return bias


def measure(n, context, tiles, reps):
    kw = dict(device="cuda", dtype=torch.bfloat16)
    kv_len = -(-(context + n) // 256) * 256
    q = torch.randn(1, HEADS, n, HEAD_DIM, **kw)
    keys = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, **kw)
    values = torch.randn_like(keys)
    mask = torch.zeros(1, 1, n, kv_len, dtype=torch.bool, device="cuda")
    mask[..., :context] = True
    mask[..., context:context + n] = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    row = {"queries": n, "context": context, "kv_len": kv_len}
    for tile in tiles:
        row[f"tile_{tile}_ms"] = layers_ms(q, keys, values, padded_bias(mask, q.dtype, tile), reps)
    exact_keys = keys[:, :, :context + n]
    row["no_mask_exact_keys_ms"] = graphed_ms(
        lambda: [F.scaled_dot_product_attention(q, exact_keys, values[:, :, :context + n], enable_gqa=True)
                 for _ in range(LAYERS)], reps)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/gpu_attention_padding_h200.json")
    parser.add_argument("--queries", default="1,2,4,8,16,17,32,64,65,128,129,192,256,257,320,384,513,1025")
    parser.add_argument("--tiles", default="1,64,128,256")
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]
    rows = []
    for n in [int(x) for x in args.queries.split(",")]:
        rows.append(measure(n, args.context, tiles, args.reps))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "layers": LAYERS, "rows": rows}, indent=1))
    print(f"{'queries':>7} " + " ".join(f"{'tile ' + str(t):>9}" for t in tiles) + f" {'no mask':>9}")
    for r in rows:
        print(f"{r['queries']:>7} " + " ".join(f"{r[f'tile_{t}_ms']:9.3f}" for t in tiles)
              + f" {r['no_mask_exact_keys_ms']:9.3f}")


if __name__ == "__main__":
    main()
