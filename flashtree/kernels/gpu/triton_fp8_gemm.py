"""Triton kernel of the weight-only FP8 product (behind :mod:`flashtree.kernels.gpu.fp8_gemm`)."""

import triton
import triton.language as tl

from flashtree.kernels.gpu.triton_gemm import (
    finish_split_tile,
    output_tile,
    store_chunk_partial,
    store_total,
)


@triton.jit
def _fp8_chunk_product(x_ptr, w_ptr, scale_rows, rows, cols, M, N, k_begin, k_end, stride_x, stride_w,
                       stride_scale_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr):
    """The float32 tile ``[BLOCK_M, BLOCK_N]`` of x[:, k_begin:k_end] @ (w * scale)[:, k_begin:k_end]^T, from
    zero. Per K block of BLOCK_K (= the scale block, 128): the e4m3 weight tile is converted to x's dtype
    (exact: every e4m3 value is a bfloat16, float16 and float32 value), multiplied with x's tile into a fresh
    float32 product (tl.dot from zero), and added to the accumulator times the block's scale, one fma per
    element: ``acc = fma(part, scale, acc)``, K blocks in K order."""
    depth = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < k_end), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < k_end), other=0.0).to(x_ptr.dtype.element_ty)  # [BN, BK]
        if IEEE:  # float32 activations: full-precision products, not TF32
            part = tl.dot(x, tl.trans(w), input_precision="ieee")  # [BM, BN]
        else:
            part = tl.dot(x, tl.trans(w))
        scale = tl.load(scale_rows + (k0 // BLOCK_K) * stride_scale_k, mask=cols < N, other=0.0)  # [BN]
        acc = tl.fma(part, scale[None, :], acc)
    return acc


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, CHUNK_K, stride_x,
                       stride_w, stride_y, stride_scale_n, stride_scale_k, SCALE_ROWS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED_SUM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    """y = x @ (w * scale)^T (+ bias) over K in chunks of CHUNK_K (a multiple of the scale block), each chunk
    summed from zero (:func:`_fp8_chunk_product`), then the chunks added from zero in chunk order and rounded
    once; SPLIT: program (tile, s) stores chunk s to ``part [chunks, M, N]`` and the ordered sum
    (triton_gemm._sum_chunks_kernel) finishes y, the same additions (FUSED_SUM: the tile's last program does,
    triton_gemm.finish_split_tile). Weight row n's scale for K block b is
    ``scale[n // SCALE_ROWS, b]`` (``stride_scale_k`` 0: one scale per row for all of K). An output element
    depends only on its row of x, its row of the weight, N and K, never on M or on the tile."""
    rows, cols = output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
    scale_rows = scale_ptr + (cols // SCALE_ROWS).to(tl.int64) * stride_scale_n  # [BN]
    if SPLIT:
        k_begin = tl.program_id(1) * CHUNK_K
        acc = _fp8_chunk_product(x_ptr, w_ptr, scale_rows, rows, cols, M, N, k_begin,
                                 tl.minimum(k_begin + CHUNK_K, K), stride_x, stride_w, stride_scale_k,
                                 BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        if FUSED_SUM:
            finish_split_tile(part_ptr, count_ptr, bias_ptr, y_ptr, acc, rows, cols, M, N, tl.num_programs(1),
                              stride_y, HAS_BIAS, BLOCK_M, BLOCK_N)
        else:
            store_chunk_partial(part_ptr, acc, rows, cols, M, N)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_begin in range(0, K, CHUNK_K):
            total += _fp8_chunk_product(x_ptr, w_ptr, scale_rows, rows, cols, M, N, k_begin,
                                        tl.minimum(k_begin + CHUNK_K, K), stride_x, stride_w, stride_scale_k,
                                        BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        store_total(y_ptr, bias_ptr, total, rows, cols, M, N, stride_y, HAS_BIAS)
