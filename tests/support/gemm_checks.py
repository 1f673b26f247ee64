"""The row-invariant product on small shapes: under ``TRITON_INTERPRET=1`` on the CPU in float32
(tests/integration/test_invariant_gemm.py; the interpreter has no bfloat16 arithmetic), and on CUDA in
float32 and bfloat16 (tests/gpu/test_invariant_gemm.py). :func:`check` returns, per dtype, whether every
row of M = 1, 7 and 64 equals the same row of the 64-row product bit for bit (and rows 5..11 alone, and on the
device with every tile of the table), the same for K cut into chunks with the chunks in programs of their own
and in one program (``chunks_identical``: K = 600 in chunks of 256, every way the same bits), and the largest
difference from torch's product; run as a module it prints that as one JSON line."""

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
        results[str(dtype)] = {"rows_identical": same and shifted, "chunks_identical": chunks_identical(gen, dtype, device),
                               "max_abs_diff": (full.float() - reference).abs().max().item()}
    return results


# how a K-chunked product may run: (split, fused_sum): one pass; chunks apart, then the sum kernel; chunks apart,
# the sum in each tile's last program
SPLIT_WAYS = ((False, None), (True, False), (True, True))


def chunks_identical(gen: torch.Generator, dtype: torch.dtype, device: str) -> bool:
    """K = 600 in chunks of 256 (two whole and one partial): every way of :data:`SPLIT_WAYS`, M = 1, 7 and 64, and
    on the device every tile, give the one-pass 64-row product's rows bit for bit; and it matches torch's product."""
    x = torch.randn(64, 600, generator=gen).to(device, dtype)
    weight = torch.randn(80, 600, generator=gen).to(device, dtype)
    bias = torch.randn(80, generator=gen).to(device, dtype)
    full = invariant_linear(x, weight, bias, chunk=256, split=False)
    tiles = [None] if interpreting() else [tile for _, tile in TILES]
    same = all(torch.equal(invariant_linear(x[:m], weight, bias, tile=tile, chunk=256, split=split, fused_sum=fused),
                           full[:m]) for m in (1, 7, 64) for split, fused in SPLIT_WAYS for tile in tiles)
    close = torch.allclose(full.float(), torch.nn.functional.linear(x.float(), weight.float(), bias.float()),
                           rtol=0, atol=1e-3 if dtype == torch.float32 else 0.5)
    return same and close


def main() -> None:
    print(json.dumps(check()))


if __name__ == "__main__":
    main()
