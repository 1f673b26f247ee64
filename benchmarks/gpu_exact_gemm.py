"""H200: the row-invariant product (kernels/gpu/gemm.py) against cuBLAS at the Qwen3-8B shape, per tile.

    python benchmarks/gpu_exact_gemm.py --out benchmarks/results/gpu_exact_gemm_h200.json

For each product of a Qwen3-8B layer (fused qkv, o, fused gate-up, down) and the LM head, and each row count
M (1 .. 2,080: plain steps to DDTree-64 at batch 32), times F.linear (cuBLAS) and :func:`invariant_linear`
with every candidate tile (bf16, CUDA-event timing of graph-free launches after warm-up, median of
``--reps``), and checks that every tile gives the reference tile's output bit for bit (the tiles may then
share the table: kernels/gpu/gemm.py TILES). Prints the best tile per M and its time against cuBLAS.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.gemm import Tile, invariant_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}  # name: (N, K)
ROWS = (1, 8, 16, 32, 64, 128, 256, 512, 1040, 2080)
REFERENCE = Tile(16, 64, 64)
CANDIDATES = (
    REFERENCE,
    Tile(16, 32, 128, stages=4), Tile(16, 64, 128, stages=4), Tile(16, 128, 64, stages=4),
    Tile(16, 32, 256, stages=3), Tile(16, 16, 256, stages=4),
    Tile(32, 64, 64, stages=4), Tile(32, 128, 64, stages=4),
    Tile(64, 64, 64, stages=4), Tile(64, 128, 64, stages=4), Tile(64, 256, 64, warps=8, stages=3),
    Tile(128, 128, 64, warps=8, stages=3), Tile(128, 256, 64, warps=8, stages=3),
)


def timed_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000)
    return statistics.median(times)


def sweep(name: str, n: int, k: int, reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    x_all = torch.randn(max(ROWS), k, generator=gen, device="cuda").bfloat16()
    full = invariant_linear(x_all, weight, tile=REFERENCE)
    rows = []
    for m in ROWS:
        x = x_all[:m]
        row = {"product": name, "n": n, "k": k, "m": m,
               "cublas_us": timed_us(lambda: torch.nn.functional.linear(x, weight), reps),
               "floor_us": (n * k + m * (n + k)) * 2 / 4.2e12 * 1e6, "tiles": []}
        for tile in CANDIDATES:
            try:
                out = invariant_linear(x, weight, tile=tile)
                same = torch.equal(out, full[:m])
                us = timed_us(lambda: invariant_linear(x, weight, tile=tile), reps)
            except Exception as err:  # a tile the compiler refuses (shared memory): recorded, skipped
                row["tiles"].append({"tile": tile._asdict(), "error": str(err)[:200]})
                continue
            row["tiles"].append({"tile": tile._asdict(), "us": us, "equals_reference": same})
        ok = [t for t in row["tiles"] if t.get("equals_reference")]
        best = min(ok, key=lambda t: t["us"]) if ok else None
        row["best"] = best
        rows.append(row)
        if best:
            print(f"{name:>8} M={m:>5}: cuBLAS {row['cublas_us']:8.1f} us  best {best['us']:8.1f} us "
                  f"({best['us'] / row['cublas_us']:.2f}x) {tuple(best['tile'].values())}  "
                  f"all tiles equal: {all(t.get('equals_reference') for t in row['tiles'] if 'us' in t)}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--products", default=",".join(SHAPES))
    args = parser.parse_args()
    rows = []
    for name in args.products.split(","):
        rows += sweep(name, *SHAPES[name], args.reps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
