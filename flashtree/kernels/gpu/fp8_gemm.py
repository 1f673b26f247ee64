"""Weight-only FP8 products on CUDA (issue #38): an FP8 checkpoint's linears keep their e4m3 weights and
float32 scales on the device, and a decode step reads one byte per weight instead of two.

:func:`fp8_linear` computes ``x @ (w * scale)^T`` with x in bfloat16 (or any float dtype), the weight
converted to x's dtype inside the kernel (exact), a float32 product per 128-wide K block scaled by that
block's factor and added in K order within chunks of K set by the weight's shape (gemm.k_chunk), the chunk
sums added in chunk order, and one rounding at the end (``triton_fp8_gemm.py``). The K step is the scale
block (``SCALE_BLOCK``), and like the exact mode's product (gemm.py) a row's result is bit for bit the same
whatever the row count, whatever the other rows hold, and whether the chunks ran in one program or apart: a tree node gets
what a plain step computes, and FP8 speculative decoding gives FP8 plain decoding's tokens. The tile (by row
count: :data:`TILES`) only decides which program computes which outputs. The large-M tiles are the same
kernel (no torch._scaled_mm: it would quantize the activations too, a different and row-dependent product).

Scales, as :class:`Fp8Linear` holds them: ``scale [ceil(N / scale_rows), 1 or ceil(K / 128)]`` float32,
the factor of weight element (n, k) being ``scale[n // scale_rows, k // 128]`` (column 0 for all k when
there is one column): ``scale_rows`` 128 for 128 x 128 blocks, 1 for one row's own factors (per-channel
checkpoints, and block-scaled parts fused where a part's rows do not fill whole blocks).
"""

from __future__ import annotations

import functools

import torch

from flashtree.kernels.gpu import interpreting
from flashtree.kernels.gpu.gemm import Tile, arrival_counts, chunk_launch, k_chunk, sum_chunks

SCALE_BLOCK = 128  # K columns per scale block, and the kernel's K step
SCALE_ROWS = (1, SCALE_BLOCK)  # weight rows per scale row: one's own, or 128-row blocks
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# the tile by row count: (largest M it serves, tile). Every entry computes each output element with the same
# sequence of 128-wide K blocks (block_k must stay SCALE_BLOCK) and at most 32 rows per tile: on Hopper (H100,
# 2026-12-06) tiles of 64 rows or more (wgmma) rounded some rows of the Qwen3-8B products one bf16 step apart from
# the 16- and 32-row tiles (mma), which broke FP8 speculative == plain tokens; 32 x 64 gave the 16-row tile's bits
# at 68 / 272 / 1,040 rows and was the fastest 32-row tile there (1.1-1.5x the 64 x 128 tile's time at 272-1,040
# rows). tests/gpu/test_fp8_gemm.py checks the table on the device. Decode rows (M <= 64) are what matters: a
# one-row product streams the weight, in N / block_n programs times its K chunks (gemm.chunk_launch).
TILES: tuple[tuple[int, Tile], ...] = ((16, Tile(16, 32, SCALE_BLOCK, warps=4, stages=4)),
                                       (32, Tile(32, 32, SCALE_BLOCK, warps=4, stages=5)),
                                       (1 << 62, Tile(32, 64, SCALE_BLOCK, warps=4, stages=4)))


def tile_for(rows: int) -> Tile:
    """The table's tile for ``rows``; in Triton's interpreter always the first (it evaluates a tl.dot as one
    numpy product, whose rounding depends on the tile's shape)."""
    if interpreting():
        return TILES[0][1]
    return next(tile for limit, tile in TILES if rows <= limit)


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_fp8_gemm

    return triton_fp8_gemm


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int,
               bias: torch.Tensor | None = None, tile: Tile | None = None, chunk: int | None = None,
               split: bool | None = None, fused_sum: bool | None = None) -> torch.Tensor:
    """x ``[..., K]`` (bf16 / fp16 / fp32), weight ``[N, K]`` e4m3 (or e5m2), scale float32 (module docstring),
    bias ``[N]`` or None -> ``[..., N]`` in x's dtype. ``tile``, ``chunk`` (K columns per chunk, a multiple of
    the scale block), ``split`` (chunks in programs of their own) and ``fused_sum`` (a split product's ordered
    sum in its last programs: gemm.arrival_counts) override the defaults (tests, benchmarks)."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8_linear: x [..., {k}] and weight {list(weight.shape)} do not fit")
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    tile = tile or tile_for(m)
    if tile.block_k != SCALE_BLOCK:
        raise ValueError(f"fp8_linear: a tile's block_k must be the scale block {SCALE_BLOCK}, got {tile.block_k}")
    chunk = chunk or k_chunk(n, k, SCALE_BLOCK, TILES[0][1].block_n)
    if chunk % SCALE_BLOCK:
        raise ValueError(f"fp8_linear: chunk {chunk} is not a multiple of the scale block {SCALE_BLOCK}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid, part = chunk_launch(m, n, k, tile, chunk, split, x.device)
        counts = arrival_counts(grid, fused_sum, x.device)
        _kernels()._fp8_linear_kernel[grid](
            rows, weight, scale, bias if bias is not None else rows, y, y if part is None else part,
            y if counts is None else counts, m, n, k, chunk, rows.stride(0), weight.stride(0), y.stride(0),
            scale.stride(0), scale.stride(1) if scale.shape[1] > 1 else 0, SCALE_ROWS=scale_rows,
            HAS_BIAS=bias is not None, SPLIT=part is not None, FUSED_SUM=counts is not None, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, IEEE=x.dtype == torch.float32,
            num_warps=tile.warps, num_stages=tile.stages)
        if part is not None and counts is None:
            sum_chunks(part, bias, y)
    return y.reshape(*lead, n)


class Fp8Linear:
    """One linear's FP8 weight ``[N, K]`` and its scales (module docstring), on the device that computes with
    them. Call it like :class:`~flashtree.kernels.cpu.quant_linear.QuantizedLinear`: ``layer(x, bias)`` ->
    ``x @ W^T (+ bias)`` ``[..., N]`` in x's dtype, ``W = float(weight) * factor``. ``name`` (the tensor, or
    the fused tensors) goes into errors."""

    ROW_INVARIANT = True  # a row's result does not depend on the row count (the exact mode may call it)

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int, name: str = "an FP8 weight"):
        if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
            raise ValueError(f"{name}: an FP8 linear takes a 2-D float8_e4m3fn or float8_e5m2 weight, "
                             f"got {weight.dtype} {list(weight.shape)}")
        rows, cols = weight.shape
        if scale_rows not in SCALE_ROWS:
            raise ValueError(f"{name}: scale_rows {scale_rows} is not allowed; allowed: {SCALE_ROWS}")
        blocks = (-(-rows // scale_rows), -(-cols // SCALE_BLOCK))
        if scale.dim() != 2 or scale.shape[0] != blocks[0] or scale.shape[1] not in (1, blocks[1]):
            raise ValueError(f"{name}: scales of shape {list(scale.shape)} do not fit a [{rows}, {cols}] weight with "
                             f"{scale_rows} row(s) per scale row; allowed: [{blocks[0]}, 1] or {list(blocks)}")
        if scale.device != weight.device:
            raise ValueError(f"{name}: weight on {weight.device}, scales on {scale.device}; allowed: one device")
        self.weight = weight.contiguous()  # [N, K]
        self.scale = scale.float().contiguous()  # [ceil(N / scale_rows), 1 or ceil(K / 128)]
        self.scale_rows = scale_rows
        self.name = name
        self.out_features, self.in_features = rows, cols

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.scale_rows, bias)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of the weight and its scales."""
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4

    def factors(self) -> torch.Tensor:
        """Each weight element's factor, ``[N, K]`` float32."""
        rows, cols = self.weight.shape
        factor = self.scale.repeat_interleave(self.scale_rows, 0)[:rows]  # [N, 1 or K blocks]
        return factor.repeat_interleave(SCALE_BLOCK, 1)[:, :cols] if factor.shape[1] > 1 else factor.expand(rows, cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` as the product uses it: ``float(weight) * factor``, in ``dtype``."""
        return (self.weight.float() * self.factors()).to(dtype)
