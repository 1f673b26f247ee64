"""How fast the CPU block kernel streams GGUF blocks it has not seen (more than the L3 cache holds), by rows of x.

    python benchmarks/cpu_block_bandwidth.py --out benchmarks/results/cpu_block_bandwidth_epyc.json
    python benchmarks/cpu_block_bandwidth.py --define COLUMNS_AT_ONE_ROW=4 ...   (a kernel build with -D flags)

For each block type (random blocks, sane fp16 scales) and each row count, ``--copies`` different [N, K] matrices
are multiplied in turn (their blocks together larger than L3, so every product reads from DRAM) with int8
activations, the engine's default; reported: GB of blocks read per second, the best of ``--repeats`` passes over
all copies (the first pass after building the kernel is a warm-up). Beside it, a float32 sum over 256 MiB with
the same threads: what a plain sequential read reaches. ``--define NAME=VALUE`` adds ``-DNAME=VALUE`` to the
kernel's build (kernels.cpp reads e.g. PREFETCH_BYTES), for comparing variants on one machine.
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


def block_gb_s(type_name: str, n: int, k: int, rows: int, copies: int, repeats: int, threads: int) -> float:
    from flashtree.kernels.cpu.quant_linear import BLOCK_TYPES, QuantizedLinear

    torch.set_num_threads(threads)
    block = BLOCK_TYPES[type_name]
    gen = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(copies):
        blocks = torch.randint(0, 256, (n, block.row_bytes(k)), dtype=torch.uint8, generator=gen)
        if block.weights == 32:  # the fp16 scale at each block's start: 0.0625, not random bits (NaN / inf)
            view = blocks.view(n, k // 32, block.block_bytes)
            view[:, :, 0], view[:, :, 1] = 0, 0x2C
        mats.append(QuantizedLinear(type_name, blocks, k, int8_activations=True))
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
    args = parser.parse_args()
    from flashtree.kernels.cpu import library

    library.CXX_FLAGS = (*library.CXX_FLAGS, *(f"-D{d}" for d in args.define))
    n, k = (int(v) for v in args.shape.split(","))
    result = {"cpu": platform.processor() or platform.machine(), "defines": args.define, "shape": [n, k],
              "copies": args.copies, "float_sum_gb_s": {}, "block_gb_s": {}}
    for threads in (int(t) for t in args.threads.split(",")):
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
