"""The weight-only FP8 product on small shapes: under ``TRITON_INTERPRET=1`` on the CPU in float32
(tests/integration/test_fp8_gemm.py; the interpreter has no bfloat16 arithmetic, but it loads float8 tensors
and converts them exactly), and on CUDA in float32 and bfloat16 (tests/gpu/test_fp8_gemm.py).

:func:`check` returns, per scale layout and dtype: whether every row of M = 1, 7 and 64 equals the same row of
the 64-row product bit for bit (and rows 5..11 alone; on the device also with every tile of the table), and
whether K cut into chunks of one scale block gives the same bits every way of gemm_checks.SPLIT_WAYS
(``chunks_identical``), and the largest difference from a float64 product of the dequantized weight, relative
to the largest output magnitude. The weight is N = 200 by K = 300: a partial N tile, a partial 128-row scale block, and three K blocks
of which the last is partial; block scales span 2^-8..2^4, so a factor applied to the wrong block shows.
Run as a module it prints the result as one JSON line."""

from __future__ import annotations

import json

import torch

from flashtree.kernels.gpu import interpreting
from flashtree.kernels.gpu.fp8_gemm import SCALE_BLOCK, TILES, Fp8Linear
from tests.support.gemm_checks import SPLIT_WAYS

N, K = 200, 300
LAYOUTS = ("block", "row_blocks", "channel")


def random_fp8_linear(layout: str, gen: torch.Generator, device: str = "cpu") -> Fp8Linear:
    """An :class:`Fp8Linear` [N, K] with random e4m3 values and random power-of-two-spread scales: ``block``
    (128 x 128 blocks), ``row_blocks`` (each row its own factor per K block), ``channel`` (one per row)."""
    values = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = {"block": -(-N // SCALE_BLOCK), "row_blocks": N, "channel": N}[layout]
    columns = 1 if layout == "channel" else -(-K // SCALE_BLOCK)
    scale = torch.exp2(torch.randint(-8, 5, (rows, columns), generator=gen).float()) * \
        (1 + torch.rand(rows, columns, generator=gen))  # [rows, columns]
    return Fp8Linear(values.to(device), scale.to(device), SCALE_BLOCK if layout == "block" else 1, name=layout)


def check(dtypes=(torch.float32,), device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for layout in LAYOUTS:
        layer = random_fp8_linear(layout, gen, device)
        reference_weight = layer.dequantize(torch.float64)  # [N, K]
        for dtype in dtypes:
            x = torch.randn(64, K, generator=gen).to(device, dtype)  # [64, K]
            bias = torch.randn(N, generator=gen).to(device, dtype)
            full = layer(x, bias)  # [64, N]
            same = all(torch.equal(layer(x[:m], bias), full[:m]) for m in (1, 7, 64))
            shifted = torch.equal(layer(x[5:12], bias), full[5:12])  # other rows beside them
            if not interpreting():  # every tile of the table gives the same bits (the interpreter uses the first)
                from flashtree.kernels.gpu.fp8_gemm import fp8_linear

                same &= all(torch.equal(fp8_linear(x, layer.weight, layer.scale, layer.scale_rows, bias, tile), full)
                            for _, tile in TILES)
            chunked = fp8_linear_chunked(layer, x, bias, split=False)
            chunks_same = all(torch.equal(fp8_linear_chunked(layer, x[:m], bias, split, fused), chunked[:m])
                              for m in (1, 7, 64) for split, fused in SPLIT_WAYS)
            reference = torch.nn.functional.linear(x.double(), reference_weight, bias.double())
            results[f"{layout}/{dtype}"] = {
                "rows_identical": bool(same and shifted), "chunks_identical": chunks_same,
                "chunked_relative_diff": ((chunked.double() - reference).abs().max() / reference.abs().max()).item(),
                "batched_3d": torch.equal(layer(x.view(8, 8, K), bias),
                                                                                    full.view(8, 8, N)),
                "relative_diff": ((full.double() - reference).abs().max() / reference.abs().max()).item()}
    return results


def fp8_linear_chunked(layer: Fp8Linear, x: torch.Tensor, bias: torch.Tensor, split: bool,
                       fused_sum: bool | None = None) -> torch.Tensor:
    """``layer``'s product with K cut into chunks of one scale block (three chunks, the last partial)."""
    from flashtree.kernels.gpu.fp8_gemm import fp8_linear

    return fp8_linear(x, layer.weight, layer.scale, layer.scale_rows, bias, chunk=SCALE_BLOCK, split=split,
                      fused_sum=fused_sum)


def main() -> None:
    print(json.dumps(check()))


if __name__ == "__main__":
    main()
