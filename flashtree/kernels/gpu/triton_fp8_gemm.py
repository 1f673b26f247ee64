"""Triton kernel of the weight-only FP8 product (behind :mod:`flashtree.kernels.gpu.fp8_gemm`)."""

import triton
import triton.language as tl

from flashtree.kernels.gpu.triton_gemm import output_tile


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                       stride_scale_n, stride_scale_k, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       IEEE: tl.constexpr):
    """y[BLOCK_M rows, BLOCK_N columns] = sum over K blocks of (x_blk @ w_blk^T) * scale (+ bias).

    Per K block of BLOCK_K (= the scale block, 128): the e4m3 weight tile is converted to x's dtype (exact:
    every e4m3 value is a bfloat16, float16 and float32 value), multiplied with x's tile into a fresh float32
    product (tl.dot from zero), and that product is added into the float32 accumulator times the block's scale,
    one fma per element: ``acc = fma(part, scale, acc)``. Weight row n's scale for K block b is
    ``scale[n // SCALE_ROWS, b]`` (``stride_scale_k`` 0: one scale per row for all of K). The K loop runs
    from 0 up in every program, nothing is split, and one rounding to y's dtype ends it: an output element
    depends only on its row of x, its row of the weight and K, never on M or on the tile (the order of
    programs, GROUP_M row tiles at a time across the columns, changes no arithmetic)."""
    rows, cols = output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
    depth = tl.arange(0, BLOCK_K)  # [BK]
    scale_rows = scale_ptr + (cols // SCALE_ROWS).to(tl.int64) * stride_scale_n  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0).to(x_ptr.dtype.element_ty)  # [BN, BK]
        if IEEE:  # float32 activations: full-precision products, not TF32
            part = tl.dot(x, tl.trans(w), input_precision="ieee")  # [BM, BN]
        else:
            part = tl.dot(x, tl.trans(w))
        scale = tl.load(scale_rows + (k0 // BLOCK_K) * stride_scale_k, mask=cols < N, other=0.0)  # [BN]
        acc = tl.fma(part, scale[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
