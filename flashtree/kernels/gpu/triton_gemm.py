"""Triton kernel of the row-invariant product (behind :mod:`flashtree.kernels.gpu.gemm`)."""

import triton
import triton.language as tl


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """y[BLOCK_M rows, BLOCK_N columns] = x @ w^T (+ bias): one program per output tile, the K loop in
    BLOCK_K steps from 0 up, accumulated in float32, one rounding to y's dtype at the end."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    depth = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)  # [BN, BK]
        if IEEE:  # float32 inputs: full-precision products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
