"""A product whose every row is computed the same way whatever the number of rows (issue #29's exact mode).

cuBLAS picks its tiles, and may split the K reduction, by the shape of the product, so the same row
of ``x`` can round differently in a one-row decode step and in a many-row verification forward.
:func:`invariant_linear` fixes what decides a row's arithmetic, from the weight's shape alone: K is cut into
chunks of :func:`k_chunk` columns (set by N and K, never by M); each chunk's product is summed from zero over
16-wide slices of K in K order into float32; the chunk sums are added from zero in chunk order; one rounding
ends it. A one-row product of a narrow weight has too few output tiles to fill the GPU, so there the chunks
run in programs of their own and a second kernel adds them up in the same order (``split``); a many-row
product adds them inside each program. Both ways, and every tile of :data:`TILES` (which only decides which
program computes which outputs), do the same additions: an output element depends only on its row of ``x``,
its row of ``weight``, N and K, so a row's result is bit-identical whatever M is and whatever the other rows
hold (rows past M in the last tile are zeros and only produce outputs that are dropped). The exact mode's
products (kernels/gpu/exact.py); the FP8 product (fp8_gemm.py) cuts K the same way.
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


# the tile by row count: (largest M it serves, tile). Every entry must compute each chunk's sum with the
# same sequence of 16-wide K slices into a float32 accumulator (block_k must divide CHUNK_ALIGN), so that which
# entry serves a product changes no bit; tests/gpu/test_invariant_gemm.py checks it across the table on the device.
# Chosen from benchmarks/gpu_exact_gemm.py (H200, Qwen3-8B products; every tile gave the same bits); the last
# entry from the sweep at 544 and 1,088 rows (H100, 2026-12-06: the four layer products 729 / 1,211 us against
# 771 / 1,262 with 128 x 128 tiles; cuBLAS 358 / 637).
TILES: tuple[tuple[int, Tile], ...] = ((16, Tile(16, 32, 256, stages=3)), (128, Tile(64, 64, 64, stages=4)),
                                       (1 << 62, Tile(128, 256, 64, warps=8, stages=3)))


CHUNK_ALIGN = 256  # chunks are a multiple of every table tile's block_k
FUSED_SUM = False  # a split product's ordered sum in its tiles' last programs (finish_split_tile), not a second kernel
SPLIT_PROGRAMS = 512  # a product with fewer output tiles than this is split by K chunks (about 4 programs per SM)
MIN_CHUNK = 1024  # K columns a chunk keeps at least (the ordered sum reads chunks x M x N floats)


def k_chunk(n: int, k: int, align: int = CHUNK_ALIGN, block_n: int | None = None) -> int:
    """K columns per chunk for an ``[N, K]`` weight: the fewest chunks (a power of two) that give a one-row
    product ``SPLIT_PROGRAMS`` programs with ``block_n``-wide tiles (default: the table's first tile),
    keeping chunks of at least ``MIN_CHUNK`` columns, rounded up to a multiple of ``align``. A function of the
    weight's shape only: every row count cuts K the same way."""
    block_n = block_n or TILES[0][1].block_n
    chunks = 1
    while -(-n // block_n) * chunks < SPLIT_PROGRAMS and k >= 2 * chunks * MIN_CHUNK:
        chunks *= 2
    return -(-k // (chunks * align)) * align


def chunk_launch(m: int, n: int, k: int, tile: Tile, chunk: int, split: bool | None, device: torch.device
                 ) -> tuple[tuple[int, int], torch.Tensor | None]:
    """(grid, partials) of a K-chunked product of ``m`` rows (this module's and fp8_gemm's): the float32
    partials ``[chunks, m, n]`` when the chunks run in programs of their own (``split``; None: where the
    product has fewer than ``SPLIT_PROGRAMS`` output tiles), then finished by :func:`sum_chunks`; else None."""
    tiles, chunks = -(-m // tile.block_m) * -(-n // tile.block_n), max(1, -(-k // chunk))
    if not (chunks > 1 and tiles < SPLIT_PROGRAMS if split is None else split):
        return (tiles, 1), None
    return (tiles, chunks), torch.empty(chunks, m, n, dtype=torch.float32, device=device)


def arrival_counts(grid: tuple[int, int], fused_sum: bool | None, device: torch.device) -> torch.Tensor | None:
    """The per-tile arrival counts ``[tiles]`` int32 (zeros) of a split launch whose tiles' last programs add the
    chunks (``fused_sum``; None: :data:`FUSED_SUM`), else None (:func:`sum_chunks` runs after the product)."""
    if grid[1] == 1 or not (FUSED_SUM if fused_sum is None else fused_sum):
        return None
    return torch.zeros(grid[0], dtype=torch.int32, device=device)


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
                     tile: Tile | None = None, chunk: int | None = None, split: bool | None = None,
                     fused_sum: bool | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with row-invariant arithmetic (module docstring).
    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's dtype. ``tile``, ``chunk``
    (K columns per chunk), ``split`` (chunks in programs of their own) and ``fused_sum`` (a split product's
    ordered sum in its last programs: :func:`arrival_counts`) override the defaults (tests, benchmarks)."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"invariant_linear: x [..., {k}] ({x.dtype}) and weight {list(weight.shape)} "
                         f"({weight.dtype}) do not fit")
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        tile = tile or tile_for(m)
        chunk = chunk or k_chunk(n, k)
        if chunk % tile.block_k:
            raise ValueError(f"invariant_linear: chunk {chunk} is not a multiple of the tile's block_k {tile.block_k}")
        grid, part = chunk_launch(m, n, k, tile, chunk, split, x.device)
        counts = arrival_counts(grid, fused_sum, x.device)
        _kernels()._invariant_linear_kernel[grid](
            rows, weight, bias if bias is not None else rows, y, y if part is None else part,
            y if counts is None else counts, m, n, k, chunk, rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, SPLIT=part is not None, FUSED_SUM=counts is not None, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, IEEE=x.dtype == torch.float32,
            num_warps=tile.warps, num_stages=tile.stages)
        if part is not None and counts is None:
            sum_chunks(part, bias, y)
    return y.reshape(*lead, n)


def sum_chunks(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, block: int = 1024) -> None:
    """y ``[M, N]`` = the chunk partials ``part [chunks, M, N]`` float32 added from zero in chunk order
    (+ bias), rounded once to y's dtype."""
    chunks, m, n = part.shape
    _kernels()._sum_chunks_kernel[(-(-m * n // block),)](
        part, bias if bias is not None else part, y, m, n, chunks, y.stride(0), HAS_BIAS=bias is not None,
        BLOCK=block)
