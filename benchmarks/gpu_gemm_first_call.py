"""GPU: does a product of a new row count cost more the first time? (issue #39's first-pass gap)

    python benchmarks/gpu_gemm_first_call.py --out benchmarks/results/gpu_gemm_first_call.json

Prefill steps multiply (rows x width) activation rows by each weight, and rows x width changes with every
batch of prompts, so a process meets new row counts M all the time. For the SmolLM2-135M products (hidden 576,
MLP 1536, vocabulary 49,152) and the Qwen3-8B ones, in bf16, this times ``torch.mm`` at many M never used
before in the process: the first call and then the second at each M (host and device, synchronized), and
reports the medians. Outputs are made before the timed calls unless ``--allocate``, so that an allocator's
first block of a new size does not fall in the first call. A first call that costs more (the library
choosing a kernel for the new shape) is a cost every new prompt length pays, inside a timed pass or a request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {"smollm2_qkv": (576, 960), "smollm2_gate_up": (576, 3072), "smollm2_down": (1536, 576),
          "smollm2_lm_head": (576, 49152), "qwen3_8b_qkv": (4096, 6144), "qwen3_8b_down": (12288, 4096)}


def timed_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> float:
    """Seconds of one ``torch.mm`` (into ``out`` when given: no allocation inside the timed call)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.mm(x, w) if out is None else torch.mm(x, w, out=out)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="37,101,229,333,517,641,777,903,1029,1187,1301,1493,1607,1777,1931",
                        help="row counts M, each used for the first time in the process")
    parser.add_argument("--allocate", action="store_true",
                        help="let each call allocate its output (the caching allocator's first block of a new size "
                             "then falls in the first call); default: outputs made before the timed calls")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "outputs_allocated_in_the_call": args.allocate, "shapes": {}}
    warm = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(warm, warm)  # the library's handle and workspace, before any timed call
    for name, (k, n) in SHAPES.items():
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        first, second = [], []
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = None if args.allocate else torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            first.append(timed_mm(x, w, out))
            second.append(timed_mm(x, w, out))
        report["shapes"][name] = {"k": k, "n": n, "first_ms": [t * 1e3 for t in first],
                                  "second_ms": [t * 1e3 for t in second],
                                  "median_first_ms": statistics.median(first) * 1e3,
                                  "median_second_ms": statistics.median(second) * 1e3}
        print(f"{name:>16}: first {statistics.median(first) * 1e3:7.3f} ms, second "
              f"{statistics.median(second) * 1e3:7.3f} ms (medians over {len(rows)} new row counts)", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
