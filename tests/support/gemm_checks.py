"""The row-invariant product on small shapes: under ``TRITON_INTERPRET=1`` on the CPU in float32
(tests/integration/test_invariant_gemm.py; the interpreter has no bfloat16 arithmetic), and on CUDA in
float32 and bfloat16 (tests/gpu/test_invariant_gemm.py). :func:`check` returns, per dtype, whether every
row of M = 1, 7 and 64 equals the same row of the 64-row product bit for bit (and rows 5..11 alone, and on the
device with every tile of the table), and
the largest difference from torch's product; run as a module it prints that as one JSON line."""

from __future__ import annotations

import json

import torch

from flashtree.kernels.gpu import interpreting
from flashtree.kernels.gpu.gemm import TILES, invariant_linear


def check(dtypes=(torch.float32,), device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for dtype in dtypes:
        x = torch.randn(64, 96, generator=gen).to(device, dtype)  # K = 96: one full and one partial K step
        weight = torch.randn(80, 96, generator=gen).to(device, dtype)  # N = 80: one full and one partial N tile
        bias = torch.randn(80, generator=gen).to(device, dtype)
        full = invariant_linear(x, weight, bias)
        same = all(torch.equal(invariant_linear(x[:m], weight, bias), full[:m]) for m in (1, 7, 64))
        shifted = torch.equal(invariant_linear(x[5:12], weight, bias), full[5:12])  # other rows beside them
        reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        if not interpreting():  # every tile of the table gives the same bits (the interpreter uses the first)
            same &= all(torch.equal(invariant_linear(x, weight, bias, tile=tile), full) for _, tile in TILES)
        results[str(dtype)] = {"rows_identical": same and shifted,
                               "max_abs_diff": (full.float() - reference).abs().max().item()}
    return results


def main() -> None:
    print(json.dumps(check()))


if __name__ == "__main__":
    main()
