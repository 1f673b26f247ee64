"""Triton kernels of the row-invariant product (behind :mod:`flashtree.kernels.gpu.gemm`): the product kernel,
and the ordered sum of K-chunk partials that ends a product split across programs (the FP8 product's too)."""

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
def _chunk_product(x_ptr, w_ptr, rows, cols, M, N, k_begin, k_end, stride_x, stride_w,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The float32 tile ``[BLOCK_M, BLOCK_N]`` of x[:, k_begin:k_end] @ w[:, k_begin:k_end]^T, from zero, K in
    BLOCK_K steps from k_begin up (tl.dot's accumulator operand: each 16-wide slice of K is added in K order
    whatever BLOCK_K is)."""
    depth = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < k_end), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < k_end), other=0.0)  # [BN, BK]
        if IEEE:  # float32 inputs: full-precision products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def store_chunk_partial(part_ptr, acc, rows, cols, M, N):
    """Chunk ``program_id(1)``'s float32 tile into ``part [chunks, M, N]`` (a split product's)."""
    part = part_ptr + tl.program_id(1).to(tl.int64) * M * N
    tl.store(part + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def finish_split_tile(part_ptr, count_ptr, bias_ptr, y_ptr, acc, rows, cols, M, N, CHUNKS, stride_y,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split product's end without a second kernel: store chunk ``program_id(1)``'s partial, count this program
    in on its output tile (``count [tiles]`` int32, zero before the launch), and the tile's last program to arrive
    adds the tile's chunks from zero in chunk order (+ bias) and rounds once: :func:`_sum_chunks_kernel`'s
    additions, so the same bits whichever program arrives last. The barrier orders every thread's partial
    before the release of the count; the last program reads the partials through L2 (``.cg``) after its acquire."""
    store_chunk_partial(part_ptr, acc, rows, cols, M, N)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
    if arrived == CHUNKS - 1:
        tl.debug_barrier()
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        chunk = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]  # [BM, BN] pointers into chunk 0
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(CHUNKS):
            total += tl.load(chunk, mask=inside, other=0.0, cache_modifier=".cg")
            chunk += M * N
        store_total(y_ptr, bias_ptr, total, rows, cols, M, N, stride_y, HAS_BIAS)


@triton.jit
def store_total(y_ptr, bias_ptr, total, rows, cols, M, N, stride_y, HAS_BIAS: tl.constexpr):
    """y's tile = the float32 total (+ bias), rounded once to y's dtype."""
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], total.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, CHUNK_K, stride_x,
                             stride_w, stride_y, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                             FUSED_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    """y = x @ w^T (+ bias) over K in chunks of CHUNK_K (a multiple of BLOCK_K), each chunk's product from zero.

    SPLIT: program (tile, s) computes chunk s alone and stores it to ``part [chunks, M, N]`` float32 (the
    ordered sum, :func:`_sum_chunks_kernel`, finishes y; with FUSED_SUM the tile's last program does, through
    ``count``: :func:`finish_split_tile`). Otherwise one program per output tile adds the
    chunks into a float32 total from zero in chunk order, adds the bias and rounds once to y's dtype: the
    same additions in the same order, so both ways give the same bits. The order of programs changes no
    arithmetic."""
    rows, cols = output_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
    if SPLIT:
        k_begin = tl.program_id(1) * CHUNK_K
        acc = _chunk_product(x_ptr, w_ptr, rows, cols, M, N, k_begin, tl.minimum(k_begin + CHUNK_K, K), stride_x,
                             stride_w, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        if FUSED_SUM:
            finish_split_tile(part_ptr, count_ptr, bias_ptr, y_ptr, acc, rows, cols, M, N, tl.num_programs(1),
                              stride_y, HAS_BIAS, BLOCK_M, BLOCK_N)
        else:
            store_chunk_partial(part_ptr, acc, rows, cols, M, N)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_begin in range(0, K, CHUNK_K):
            total += _chunk_product(x_ptr, w_ptr, rows, cols, M, N, k_begin, tl.minimum(k_begin + CHUNK_K, K),
                                    stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        store_total(y_ptr, bias_ptr, total, rows, cols, M, N, stride_y, HAS_BIAS)


@triton.jit
def _sum_chunks_kernel(part_ptr, bias_ptr, y_ptr, M, N, CHUNKS, stride_y, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y[i] = ((0 + part[0, i]) + part[1, i]) + ... (+ bias), rounded once: the one-pass kernel's additions."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat over [M, N]
    inside = index < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    chunk = part_ptr + index  # [BLOCK] pointers into chunk 0
    for _ in range(CHUNKS):
        total += tl.load(chunk, mask=inside, other=0.0)
        chunk += M * N
    row, col = index // N, index % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + col, total.to(y_ptr.dtype.element_ty), mask=inside)
