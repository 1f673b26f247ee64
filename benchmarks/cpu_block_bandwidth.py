"""How fast the CPU block kernel streams GGUF blocks it has not seen (more than the L3 cache holds), by rows of x.

    python benchmarks/cpu_block_bandwidth.py --out benchmarks/results/cpu_block_bandwidth_epyc.json
    python benchmarks/cpu_block_bandwidth.py --define COLUMNS_AT_ONE_ROW=4 ...   (a kernel build with -D flags)

For each block type (random blocks, sane fp16 scales) and each row count, ``--copies`` different [N, K] matrices
are multiplied in turn (their blocks together larger than L3, so every product reads from DRAM) with int8
activations, the engine's default; reported: GB of blocks read per second, the best of ``--repeats`` passes over
all copies (the first pass after building the kernel is a warm-up). Beside it, a float32 sum over 256 MiB with
the same threads: what a plain sequential read reaches. ``--define NAME=VALUE`` adds ``-DNAME=VALUE`` to the
kernel's build (kernels.cpp reads e.g. PREFETCH_BYTES), for comparing variants on one machine.

``--hot``: instead, the kernel's own speed where memory does not bound it: one [256, K] matrix that stays in
the L2 cache, multiplied over and over (best of 30 x 20 calls), in G weights per second. On a shared
machine it varies far less than the DRAM figures, so it is what to compare kernel changes by.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def float_read_gb_s(threads: int) -> float:
    torch.set_num_threads(threads)
    a = torch.randn(64 * 1024 * 1024)
    a.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        a.sum()
    return a.numel() * 4 * 3 / (time.perf_counter() - t0) / 1e9


SCALE_BYTES = {"Q4_K": (0, 2), "Q6_K": (208,)}  # where a super-block's fp16 scales sit (32-weight blocks: 0)


def random_matrix(type_name: str, n: int, k: int, gen: torch.Generator):
    """Random blocks, every fp16 scale 0.0625 (not random bits: NaN / inf), as the engine holds them."""
    from flashtree.kernels.cpu.quant_linear import BLOCK_TYPES, QuantizedLinear

    block = BLOCK_TYPES[type_name]
    blocks = torch.randint(0, 256, (n, block.row_bytes(k)), dtype=torch.uint8, generator=gen)
    view = blocks.view(n, k // block.weights, block.block_bytes)
    for at in SCALE_BYTES.get(type_name, (0,)):
        view[:, :, at], view[:, :, at + 1] = 0, 0x2C
    return QuantizedLinear(type_name, blocks, k, int8_activations=True)


def hot_g_weights_s(type_name: str, k: int, rows: int, threads: int) -> float:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    matrix, x = random_matrix(type_name, 256, k, gen), torch.randn(rows, k, generator=gen)
    for _ in range(20):
        matrix(x)
    best = float("inf")
    for _ in range(30):
        t0 = time.perf_counter()
        for _ in range(20):
            matrix(x)
        best = min(best, (time.perf_counter() - t0) / 20)
    return 256 * k / best / 1e9


def block_gb_s(type_name: str, n: int, k: int, rows: int, copies: int, repeats: int, threads: int) -> float:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    mats = [random_matrix(type_name, n, k, gen) for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen)
    for m in mats:
        m(x)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in mats:
            m(x)
        best = max(best, mats[0].blocks.numel() * copies / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--types", default="Q4_0,Q8_0")
    parser.add_argument("--shape", default="6144,2048", help="N,K of each matrix")
    parser.add_argument("--rows", default="1,2,3,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel build")
    parser.add_argument("--hot", action="store_true", help="the kernel's speed from the L2 cache (see above)")
    args = parser.parse_args()
    from flashtree.kernels.cpu import library

    library.CXX_FLAGS = (*library.CXX_FLAGS, *(f"-D{d}" for d in args.define))
    n, k = (int(v) for v in args.shape.split(","))
    result = {"cpu": platform.processor() or platform.machine(), "defines": args.define, "shape": [n, k],
              "copies": args.copies, "float_sum_gb_s": {}, "block_gb_s": {}}
    if args.hot:
        result = {"cpu": result["cpu"], "defines": args.define, "k": k, "hot_g_weights_s": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        if args.hot:
            for type_name in args.types.split(","):
                for rows in (int(r) for r in args.rows.split(",")):
                    rate = hot_g_weights_s(type_name, k, rows, threads)
                    result["hot_g_weights_s"][f"{type_name} rows={rows} threads={threads}"] = round(rate, 1)
                    print(f"{type_name} rows={rows} threads={threads}: {rate:.1f} G weights/s (hot)", flush=True)
            continue
        result["float_sum_gb_s"][threads] = round(float_read_gb_s(threads), 1)
        for type_name in args.types.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                gb_s = block_gb_s(type_name, n, k, rows, args.copies, args.repeats, threads)
                result["block_gb_s"][f"{type_name} rows={rows} threads={threads}"] = round(gb_s, 1)
                print(f"{type_name} rows={rows} threads={threads}: {gb_s:.1f} GB/s", flush=True)
        print(f"float32 sum, {threads} threads: {result['float_sum_gb_s'][threads]} GB/s", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
