"""Triton kernel of the row-invariant product (behind :mod:`flashtree.kernels.gpu.gemm`)."""

import triton
import triton.language as tl


@triton.jit
def output_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows ``[BLOCK_M]`` and columns ``[BLOCK_N]`` of program ``pid``'s output tile: programs go
    GROUP_M row tiles at a time across the columns (weight tiles stay in L2 between row tiles)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    """y[BLOCK_M rows, BLOCK_N columns] = x @ w^T (+ bias): one program per output tile, the K loop from 0 up,
    every step accumulating into the float32 tile (tl.dot's accumulator operand, so the products of each
    16-wide slice of K are added to it in K order whatever BLOCK_K is), one rounding to y's dtype at the end.
    Programs go GROUP_M row tiles at a time across the columns (weight tiles stay in L2 between row tiles);
    the order of programs changes no arithmetic."""
    rows, cols = output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
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
