"""Checks and references shared by the CPU block kernel's tests: its AVX2 build against the build this CPU
picks, a row's bits alone and in a batch, and the int8 activations' rounding."""

from __future__ import annotations

import torch

from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu.quant_linear import QuantizedLinear


def assert_avx2_build_gives_the_same_bits(monkeypatch, cases: list[tuple[str, torch.Tensor, torch.Tensor]],
                                          int8_activations: bool) -> None:
    """For each ``(type name, blocks, x)``: the AVX2 build's product of ``x`` (all rows at once, and row
    by row) equals, bit for bit, the product of the build this CPU picks."""
    expected = [QuantizedLinear(t, blocks, x.shape[1], int8_activations=int8_activations)(x) for t, blocks, x in cases]
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: {"avx2", "f16c", "fma"})
    cpu_library.load_kernels.cache_clear()
    try:
        for (type_name, blocks, x), want in zip(cases, expected):
            avx2 = QuantizedLinear(type_name, blocks, x.shape[1], int8_activations=int8_activations)
            assert torch.equal(avx2(x), want), type_name
            assert torch.equal(torch.cat([avx2(x[i:i + 1]) for i in range(len(x))]), want), type_name
    finally:
        cpu_library.load_kernels.cache_clear()


def assert_rows_independent_of_the_call(holder: QuantizedLinear, x: torch.Tensor, bias: torch.Tensor,
                                        row_counts: tuple[int, ...]) -> None:
    """Each row of ``x [R, K]`` gets the same bits alone, in the first ``n`` rows for every ``n`` in
    ``row_counts``, and in a run of rows starting mid-batch."""
    alone = torch.cat([holder(x[i:i + 1], bias) for i in range(len(x))])
    for rows in row_counts:
        assert torch.equal(holder(x[:rows], bias), alone[:rows]), rows
    middle = slice(len(x) // 2 - 2, len(x) - 1)
    assert torch.equal(holder(x[middle], bias), alone[middle])


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel rounds it for int8 activations, ``q * d`` per 32 values (float64, exact)."""
    blocks = x.reshape(x.shape[0], -1, 32)  # [M, B, 32]
    scale = blocks.abs().amax(dim=-1) / 127  # [M, B] (float32, as the kernel divides)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])  # ties to even, like the kernel's conversion
    return (q.double() * scale.double()[..., None]).reshape(x.shape)
