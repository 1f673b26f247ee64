"""H200: ms per plain decode step at Qwen3-8B shape (random bf16 weights) vs the HBM floor.

    python benchmarks/gpu_decode_step.py --out benchmarks/results/gpu_decode_step.json

Floor = the bytes a step reads / measured device copy bandwidth (bytes read + written per second). A step
reads every weight but the input embedding table (B of its rows; a tied table is read whole by the LM head
and counts once) and the K/V of every context token of every row (``read_bytes``). Results before
2026-12-07 divided all parameter bytes instead (``weights_only_floor_ms``: the embedding table in, the K/V
out), which made batch 1 look closer to its floor and batch 32 further from it.
Each row: B requests with a ``--context``-token prompt, then ``--steps`` timed engine steps.
``--kernels fused,torch`` times the fused Triton kernels (flashtree/kernels/gpu/) and the plain
torch ops side by side. ``--shape tiny`` runs a 2-layer toy model with the same vocabulary: its
step is almost all host time (scheduling, input copies, graph launch, the one sync).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, write_config  # noqa: E402

TINY = dict(QWEN3_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64)

from flashtree import SamplingParams  # noqa: E402
from flashtree.config import EngineConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402


def copy_bandwidth(n_bytes: int = 2 << 30) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n_bytes * reps / (time.perf_counter() - t0)


WARM_STEPS = 5  # untimed steps after the first token (graphs captured)


def read_bytes(engine: LLMEngine, batch: int, context: int, steps: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one timed plain step reads: the distinct weights less the input
    embedding's unread rows, and ``batch`` rows' K/V over the mean context of the timed steps."""
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (tied tensors once)
    table = model.model.embed_tokens.weight
    if table is not model.lm_head.weight:
        weights -= table.numel() * table.element_size()
    cfg = model.config
    mean_context = context + 1 + WARM_STEPS + (steps - 1) / 2
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * table.element_size()  # K, V
    return weights, int(batch * mean_context * per_token)


def time_steps(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps * 20 + 50, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(0, 150000, (context,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(len(r.output_ids) == 0 for r in reqs):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()  # warm up (captures graphs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / steps
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu_decode_step.json")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--modes", default="graphs,eager", help="graphs and/or eager")
    parser.add_argument("--kernels", default="fused", help="fused and/or torch (the small per-layer ops)")
    parser.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    args = parser.parse_args()
    shape = QWEN3_8B if args.shape == "qwen3-8b" else TINY
    model_dir = write_config(f"/tmp/flashtree-{args.shape}", shape)
    bandwidth = copy_bandwidth()
    rows = []
    variants = [(m == "graphs", k == "fused") for k in args.kernels.split(",") for m in args.modes.split(",")]
    for graphs, fused in variants:
        config = EngineConfig.of(model=str(model_dir), random_weights=True, max_running=32, max_context=2048,
                                 cuda_graphs=graphs, device="cuda", gpu_kernels=fused)
        engine = LLMEngine(config)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        for batch in [int(b) for b in args.batches.split(",")]:
            ms = time_steps(engine, batch, args.context, args.steps)
            weights_read, kv_read = read_bytes(engine, batch, args.context, args.steps)
            floor_ms = (weights_read + kv_read) / bandwidth * 1000
            rows.append({"shape": args.shape, "cuda_graphs": graphs, "fused_kernels": engine.model.fused_kernels,
                         "batch": batch, "context": args.context, "ms_per_step": ms,
                         "weight_bytes_read": weights_read, "kv_bytes_read": kv_read,
                         "floor_ms": floor_ms, "fraction_of_floor": floor_ms / ms,
                         "weights_only_floor_ms": weight_bytes / bandwidth * 1000,
                         "tokens_per_s": batch * 1000 / ms})
            print(json.dumps(rows[-1]), flush=True)
        del engine
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'graphs':>6} {'fused':>5} {'batch':>5} {'ms/step':>8} {'floor':>6} {'% floor':>7} {'tok/s':>8}")
    for r in rows:
        print(f"{r['cuda_graphs']!s:>6} {r['fused_kernels']!s:>5} {r['batch']:>5} {r['ms_per_step']:8.2f} "
              f"{r['floor_ms']:6.2f} "
              f"{100 * r['fraction_of_floor']:6.1f}% {r['tokens_per_s']:8.1f}")


if __name__ == "__main__":
    main()
