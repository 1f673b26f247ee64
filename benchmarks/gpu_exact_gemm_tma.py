"""H100 / H200, a prototype: would the row-invariant product (kernels/gpu/gemm.py) get nearer cuBLAS at verify
widths (hundreds of rows) if its tiles came in through TMA tensor descriptors, or through pointer loads
without the K mask (chunks are whole K steps at every Qwen3-8B shape)?

    python benchmarks/gpu_exact_gemm_tma.py --out benchmarks/results/gpu_exact_gemm_tma_h100.json

Same chunked arithmetic as ``invariant_linear`` (K cut by ``k_chunk``, each chunk's product from zero in K
order, chunk sums in chunk order, split across programs where ``chunk_launch`` says so): each variant is checked
bit for bit against ``invariant_linear`` and timed beside it and cuBLAS (CUDA events, median of ``--reps``).
Not used by the engine: a variant that wins moves into kernels/gpu/ with the table's tests.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.gemm import Tile, chunk_launch, invariant_linear, k_chunk, sum_chunks  # noqa: E402
from flashtree.kernels.gpu.triton_gemm import output_tile, store_chunk_partial, store_total  # noqa: E402
from gpu_exact_gemm import SHAPES, timed_us  # noqa: E402  (benchmarks/ is the script's directory)

TILES = (Tile(128, 256, 64, warps=8, stages=3), Tile(128, 128, 64, warps=8, stages=4),
         Tile(128, 128, 64, warps=8, stages=3), Tile(64, 128, 64, warps=4, stages=4))


@triton.jit
def _chunk_tma(x_desc, w_desc, m0, n0, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = tl.dot(x_desc.load([m0, k0]), tl.trans(w_desc.load([n0, k0])), acc)
    return acc


@triton.jit
def _chunk_unmasked_k(x_ptr, w_ptr, rows, cols, M, N, k_begin, k_end, stride_x, stride_w,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    depth = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x + (k_begin + depth)[None, :]  # [BM, BK]
    w_at = w_ptr + cols[:, None].to(tl.int64) * stride_w + (k_begin + depth)[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_begin, k_end, BLOCK_K):
        acc = tl.dot(tl.load(x_at, mask=rows[:, None] < M, other=0.0),
                     tl.trans(tl.load(w_at, mask=cols[:, None] < N, other=0.0)), acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    return acc


@triton.jit
def _variant_kernel(x_desc, w_desc, x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, CHUNK_K, stride_x, stride_w, stride_y,
                    TMA: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rows, cols = output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0, n0 = tl.min(rows, axis=0), tl.min(cols, axis=0)
    if SPLIT:  # this program's chunk alone
        first = tl.program_id(1) * CHUNK_K
        last = tl.minimum(first + CHUNK_K, K)
    else:
        first = 0
        last = K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_begin in range(first, last, CHUNK_K):
        k_end = tl.minimum(k_begin + CHUNK_K, K)
        if TMA:
            total += _chunk_tma(x_desc, w_desc, m0, n0, k_begin, k_end, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            total += _chunk_unmasked_k(x_ptr, w_ptr, rows, cols, M, N, k_begin, k_end, stride_x, stride_w,
                                       BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT:
        store_chunk_partial(part_ptr, total, rows, cols, M, N)
    else:
        store_total(y_ptr, y_ptr, total, rows, cols, M, N, stride_y, HAS_BIAS=False)


def variant_linear(x: torch.Tensor, w: torch.Tensor, tile: Tile, tma: bool) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = x.shape, w.shape[0]
    chunk = k_chunk(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid, part = chunk_launch(m, n, k, tile, chunk, None, x.device)
    x_desc = TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k]) if tma else x
    w_desc = TensorDescriptor.from_tensor(w, [tile.block_n, tile.block_k]) if tma else w
    _variant_kernel[grid](x_desc, w_desc, x, w, y, y if part is None else part, m, n, k, chunk, x.stride(0),
                          w.stride(0), y.stride(0), TMA=tma, SPLIT=part is not None, BLOCK_M=tile.block_m,
                          BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, num_warps=tile.warps,
                          num_stages=tile.stages)
    if part is not None:
        sum_chunks(part, None, y)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="544,1088")
    parser.add_argument("--products", default="o,qkv,gate_up,down")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for name in args.products.split(","):
        n, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            reference = invariant_linear(x, w)
            row = {"product": name, "m": m, "cublas_us": timed_us(lambda: torch.nn.functional.linear(x, w), args.reps),  # noqa: B023
                   "invariant_us": timed_us(lambda: invariant_linear(x, w), args.reps), "variants": []}  # noqa: B023
            for tile in TILES:
                for tma in (True, False):
                    entry = {"tile": tile._asdict(), "tma": tma}
                    try:
                        entry["same_bits"] = torch.equal(variant_linear(x, w, tile, tma), reference)
                        entry["us"] = timed_us(lambda: variant_linear(x, w, tile, tma), args.reps)  # noqa: B023
                    except Exception as err:  # noqa: BLE001  (a variant the compiler refuses: recorded)
                        entry["error"] = str(err)[:300]
                    row["variants"].append(entry)
            rows.append(row)
            print(f"{name:>8} M={m:>5} cuBLAS {row['cublas_us']:7.1f} invariant {row['invariant_us']:7.1f} | " + " ".join(
                f"{tuple(v['tile'].values())[:3]}{'T' if v['tma'] else 'P'}:"
                + (f"{v['us']:.0f}{'' if v['same_bits'] else '!DIFF'}" if "us" in v else "ERR") for v in row["variants"]),
                flush=True)
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    errors = {v["error"] for r in rows for v in r["variants"] if "error" in v}
    for err in errors:
        print("error:", err)


if __name__ == "__main__":
    main()
