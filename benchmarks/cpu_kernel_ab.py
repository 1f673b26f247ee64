"""The CPU block kernel against another version of itself, in one process, calls alternating.

    python benchmarks/cpu_kernel_ab.py --baseline HEAD~1 --types Q4_0,Q4_K,Q6_K --rows 1,8,512 \
        --out benchmarks/results/cpu_kernel_ab_epyc.json

``--baseline`` is a git revision whose ``flashtree/kernels/cpu/kernels.cpp`` is built beside the working
tree's (same compiler and flags). Both libraries multiply the same random blocks (every fp16 scale 0.0625)
by the same x with int8 activations, the two calls alternating ``--pairs`` times; reported per (type, rows):
each side's median G multiply-adds per second and the median of the pairs' time ratios (baseline / current:
above 1, the current kernel is faster). On a shared machine whose speed swings by tens of percent from one
second to the next, paired ratios are what stays put; each side's own figures are for orientation only.
A baseline older than 69035c5 may run its multi-row products 25-30% slow at random (its int8 copy of x
was only 16-byte aligned, so whether its 32-byte loads straddled cache lines depended on the allocator):
check such a baseline against itself (--baseline REV with REV checked out) before reading a ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SOURCE = "flashtree/kernels/cpu/kernels.cpp"


def baseline_library(revision: str) -> ctypes.CDLL:
    """The kernel of ``revision`` built like the working tree's (flashtree.kernels.cpu.library's flags)."""
    import hashlib

    from flashtree.kernels.cpu import library

    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    flags = (*library.CXX_FLAGS, *library.isa_compiler_flags(library.cpu_flags()))
    key = hashlib.sha256("\0".join([text, *flags]).encode()).hexdigest()[:16]
    path = library.kernel_cache_dir() / f"flashtree_block_kernels-baseline-{key}.so"
    if not path.is_file():
        library.build_library(library.find_compiler(), path, flags, text)
    lib = ctypes.CDLL(str(path))
    lib.flashtree_block_gemm.restype = ctypes.c_int
    lib.flashtree_block_gemm.argtypes = library.load_kernels().flashtree_block_gemm.argtypes
    return lib


def paired(type_name: str, n: int, k: int, rows: int, pairs: int, threads: int, libs) -> dict:
    from cpu_block_bandwidth import random_matrix

    gen = torch.Generator().manual_seed(0)
    matrix = random_matrix(type_name, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    y = torch.empty(rows, n)

    def call(lib) -> float:
        t0 = time.perf_counter()
        status = lib.flashtree_block_gemm(matrix.kernel_code, x.data_ptr(), matrix.kernel_operand, None,
                                          y.data_ptr(), rows, n, k, threads)
        assert status == 0, status
        return time.perf_counter() - t0

    for lib in libs:
        call(lib)
    times = [[], []]
    for i in range(pairs):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for side in order:
            times[side].append(call(libs[side]))
    macs = rows * n * k
    return {"baseline_gmac_s": macs / statistics.median(times[0]) / 1e9,
            "current_gmac_s": macs / statistics.median(times[1]) / 1e9,
            "speedup": statistics.median(b / c for b, c in zip(*times))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="git revision of the kernel to compare against")
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--shape", default="6144,2048", help="N,K of the matrix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--out")
    args = parser.parse_args()
    from flashtree.kernels.cpu.library import load_kernels

    torch.set_num_threads(args.threads)
    libs = (baseline_library(args.baseline), load_kernels())
    n, k = (int(v) for v in args.shape.split(","))
    result = {"cpu": platform.processor() or platform.machine(), "baseline": args.baseline,
              "current": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, check=False,
                                        capture_output=True, text=True).stdout.strip(),
              "shape": [n, k], "threads": args.threads, "pairs": args.pairs, "runs": {}}
    for type_name in args.types.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            run = paired(type_name, n, k, rows, args.pairs, args.threads, libs)
            result["runs"][f"{type_name} rows={rows}"] = {key: round(v, 3) for key, v in run.items()}
            print(f"{type_name} rows={rows}: baseline {run['baseline_gmac_s']:.1f}, current "
                  f"{run['current_gmac_s']:.1f} G MAC/s; paired speedup {run['speedup']:.3f}x", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
