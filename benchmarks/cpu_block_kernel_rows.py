"""Time of the CPU block kernel (kernels/cpu/quant_linear.py) per product by row count, at SmolLM2's
layer shapes, against the same product on the fp32 weights (torch / MKL or OpenBLAS).

A verify pass of a speculative round multiplies every weight by 2-8 rows instead of one; this shows
what each extra row costs on this CPU (it names the instruction set the kernel was built for).

    python benchmarks/cpu_block_kernel_rows.py [--threads 2] [--out benchmarks/results/cpu_block_kernel_rows.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu.quant_linear import QuantizedLinear

# SmolLM2-135M: (name, rows N, columns K, GGUF type) of one layer's products and the head
SHAPES = (("qkv", 960, 576, "Q4_1"), ("o", 576, 576, "Q4_1"), ("gate_up", 3072, 576, "Q4_1"),
          ("down", 576, 1536, "Q4_1"), ("lm_head", 49152, 576, "Q8_0"))


def holder(rows: int, cols: int, type_name: str, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32), qtype)
    dense = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(rows, cols))
    return QuantizedLinear(type_name, torch.from_numpy(np.array(data).reshape(rows, -1)), cols), dense


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12,16,17,24,32,48,64",
                        help="comma-separated row counts (the kernel takes any; so does linear())")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_block_kernel_rows.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = cpu_library.isa_compiler_flags(cpu_library.cpu_flags())
    results = []
    for name, n, k, type_name in SHAPES:
        quant, dense = holder(n, k, type_name, seed=n + k)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k)
            kernel = best_ms(lambda: quant(x), args.reps)
            fp32 = best_ms(lambda: x @ dense.T, args.reps)
            results.append({"product": name, "N": n, "K": k, "type": type_name, "rows": m,
                            "kernel_ms": round(kernel, 4), "fp32_ms": round(fp32, 4)})
    totals = {}
    for r in results:  # one decoder layer x 30 + the head: a forward of `rows` tokens
        weight = 1 if r["product"] == "lm_head" else 30
        entry = totals.setdefault(r["rows"], {"kernel_ms": 0.0, "fp32_ms": 0.0})
        entry["kernel_ms"] += weight * r["kernel_ms"]
        entry["fp32_ms"] += weight * r["fp32_ms"]
    out = {"cpu": platform.processor() or platform.machine(), "isa_flags": list(flags), "threads": args.threads,
           "torch": torch.__version__, "products": results,
           "smollm2_forward_products_ms": {m: {k: round(v, 2) for k, v in t.items()} for m, t in totals.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"isa {' '.join(flags)}; SmolLM2 products of one forward (30 layers + head), ms:")
    print("rows  kernel   fp32   kernel x 1-row")
    for m, t in totals.items():
        print(f"{m:>4} {t['kernel_ms']:7.2f} {t['fp32_ms']:7.2f}   {t['kernel_ms'] / totals[1]['kernel_ms']:5.2f}")


if __name__ == "__main__":
    main()
