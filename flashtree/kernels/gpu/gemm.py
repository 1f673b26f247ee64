"""A product whose every row is computed the same way whatever the number of rows (issue #29's exact mode).

cuBLAS picks its tiles, and may split the K reduction, by the shape of the product, so the same row
of ``x`` can round differently in a one-row decode step and in a many-row verification forward.
:func:`invariant_linear` fixes what decides a row's arithmetic: the K reduction in one
order from 0 up (16-wide slices of K added into a float32 accumulator), no split-K, and one rounding at the
end; the tile shape (:data:`TILES`, by row count) only decides which program computes which outputs. An
output element then depends only on its row of ``x``, its row of ``weight`` and K: a row's result is
bit-identical whatever M is and whatever the other rows hold (rows past M in the last tile are zeros and only produce outputs
that are dropped). The exact mode's products (kernels/gpu/exact.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashtree.kernels.gpu import interpreting


class Tile(NamedTuple):
    """One launch configuration: output tile, K step, row tiles per program group, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    warps: int = 4
    stages: int = 3


# the tile by row count: (largest M it serves, tile). Every entry must compute each output element with the
# same sequence of 16-wide K slices into a float32 accumulator (no split-K), so that which entry serves a
# product changes no bit; tests/gpu/test_invariant_gemm.py checks it across the table on the device.
# Chosen from benchmarks/gpu_exact_gemm.py (H200, Qwen3-8B products; every tile gave the same bits).
TILES: tuple[tuple[int, Tile], ...] = ((16, Tile(16, 32, 256, stages=3)), (128, Tile(64, 64, 64, stages=4)),
                                       (1 << 62, Tile(128, 128, 64, warps=8, stages=3)))


def tile_for(rows: int) -> Tile:
    """The table's tile for ``rows``; in Triton's interpreter always the first (it evaluates a tl.dot as one
    numpy product, whose rounding depends on the tile's shape; on the device the tiles round alike)."""
    if interpreting():
        return TILES[0][1]
    return next(tile for limit, tile in TILES if rows <= limit)


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_gemm

    return triton_gemm


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: Tile | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with row-invariant arithmetic (module docstring).
    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's dtype. ``tile`` overrides
    the table's choice (benchmarks)."""
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
        tile = tile or tile_for(m)
        grid = (-(-m // tile.block_m) * -(-n // tile.block_n),)
        _kernels()._invariant_linear_kernel[grid](
            rows, weight, bias if bias is not None else rows, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m, IEEE=x.dtype == torch.float32, num_warps=tile.warps, num_stages=tile.stages)
    return y.reshape(*lead, n)
