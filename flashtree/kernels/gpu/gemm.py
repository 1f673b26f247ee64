"""A product whose every row is computed the same way whatever the number of rows (issue #29's exact mode).

cuBLAS picks its tiles, and may split the K reduction, by the shape of the product, so the same row
of ``x`` can round differently in a one-row decode step and in a many-row verification forward.
:func:`invariant_linear` fixes what decides a row's arithmetic: one tile shape for every M
(:data:`BLOCK_M` x :data:`BLOCK_N` outputs), the K reduction in :data:`BLOCK_K` steps in one order from
0 up, no split-K, float32 accumulation and one rounding at the end. An output element then depends
only on its row of ``x``, its row of ``weight`` and K: a row's result is bit-identical whatever M is
and whatever the other rows hold (rows past M in the last tile are zeros and only produce outputs
that are dropped). It is the building block of the exact mode; the engine does not call it yet.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # the one tile shape (tl.dot needs 16 or more on each side)


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_gemm

    return triton_gemm


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with row-invariant arithmetic (module docstring).
    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's dtype."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"invariant_linear: x [..., {k}] ({x.dtype}) and weight {list(weight.shape)} "
                         f"({weight.dtype}) do not fit")
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
        _kernels()._invariant_linear_kernel[grid](
            rows, weight, bias if bias is not None else rows, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            IEEE=x.dtype == torch.float32)
    return y.reshape(*lead, n)
