"""H200: the row-invariant product (kernels/gpu/gemm.py) against cuBLAS at the Qwen3-8B shape, per tile.

    python benchmarks/gpu_exact_gemm.py --out benchmarks/results/gpu_exact_gemm_h200.json

For each product of a Qwen3-8B layer (fused qkv, o, fused gate-up, down) and the LM head, and each row count
M (1 .. 2,080: plain steps to DDTree-64 at batch 32), times F.linear (cuBLAS) and :func:`invariant_linear`
with every candidate tile (bf16, CUDA-event timing of graph-free launches after warm-up, median of
``--reps``), and checks that every tile gives the reference tile's output bit for bit (the tiles may then
share the table: kernels/gpu/gemm.py TILES). Prints the best tile per M and its time against cuBLAS.

    python benchmarks/gpu_exact_gemm.py --decode --out benchmarks/results/gpu_exact_gemm_decode_h100.json

``--decode``: the rows of decode steps and small verify forwards (M = 1 .. 64), timed the way a step runs them
(CUDA graph replays over enough weight copies to defeat L2: gpu_fp8.time_calls_us): cuBLAS, the table's
product with K cut by :func:`k_chunk` (chunks in programs of their own where the tiles are few, the default),
the same ended in each tile's last program instead of the sum kernel (``fused_sum``), the same chunks in one
program, and K in one chunk (no split at all); each checked bit for bit against the
one-pass product of the same chunks.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.gemm import CHUNK_ALIGN, Tile, invariant_linear, k_chunk, tile_for  # noqa: E402

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
    Tile(128, 128, 64, warps=8, stages=4), Tile(128, 128, 128, warps=8, stages=3), Tile(256, 128, 64, warps=8, stages=3),
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


def sweep(name: str, n: int, k: int, reps: int, row_counts: tuple[int, ...] = ROWS) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    x_all = torch.randn(max(row_counts), k, generator=gen, device="cuda").bfloat16()
    full = invariant_linear(x_all, weight, tile=REFERENCE)
    rows = []
    for m in row_counts:
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
        table = next((t for t in row["tiles"] if t["tile"] == tile_for(m)._asdict() and "us" in t), None)
        row["table_us"] = table and table["us"]
        if best:
            print(f"{name:>8} M={m:>5}: cuBLAS {row['cublas_us']:8.1f} us  table's tile {row['table_us'] or 0:8.1f} us  "
                  f"best {best['us']:8.1f} us "
                  f"({best['us'] / row['cublas_us']:.2f}x) {tuple(best['tile'].values())}  "
                  f"all tiles equal: {all(t.get('equals_reference') for t in row['tiles'] if 'us' in t)}", flush=True)
    return rows


DECODE_ROWS = (1, 4, 16, 32, 64)


def decode_rows(name: str, n: int, k: int) -> list[dict]:
    from gpu_fp8 import L2_FLUSH_BYTES, copy_bandwidth, time_calls_us

    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, -(-L2_FLUSH_BYTES // (2 * n * k)))
    weights = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16() for _ in range(copies)]
    bandwidth, chunk, whole = copy_bandwidth("cuda"), k_chunk(n, k), -(-k // CHUNK_ALIGN) * CHUNK_ALIGN
    ways = {"split": {"chunk": chunk, "fused_sum": False}, "fused_sum": {"chunk": chunk, "fused_sum": True},
            "one_program": {"chunk": chunk, "split": False}, "no_chunks": {"chunk": whole}}
    rows = []
    for m in DECODE_ROWS:
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        reference = invariant_linear(x, weights[0], chunk=chunk, split=False)
        row = {"product": name, "n": n, "k": k, "m": m, "chunk": chunk, "floor_us": 2 * n * k / bandwidth * 1e6,
               "cublas_us": time_calls_us([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in weights], "cuda")}
        for way, kwargs in ways.items():
            row[f"{way}_us"] = time_calls_us([lambda w=w, x=x, kw=kwargs: invariant_linear(x, w, **kw) for w in weights],
                                             "cuda")
            if way != "no_chunks":
                row[f"{way}_same_bits"] = torch.equal(invariant_linear(x, weights[0], **kwargs), reference)
        print(json.dumps(row), flush=True)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--products", default=",".join(SHAPES))
    parser.add_argument("--decode", action="store_true", help="graph-timed decode rows, split K against not")
    parser.add_argument("--rows", default=None, help="row counts of the tile sweep (default: 1 .. 2,080)")
    args = parser.parse_args()
    rows = []
    for name in args.products.split(","):
        row_counts = tuple(int(m) for m in args.rows.split(",")) if args.rows else ROWS
        rows += decode_rows(name, *SHAPES[name]) if args.decode else sweep(name, *SHAPES[name], args.reps, row_counts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
