"""Triton kernels of tree attention (behind :mod:`flashtree.kernels.gpu.attention`): each row's new tokens over
its committed cache entries and the new tokens its mask allows, split over the keys and merged."""

import triton
import triton.language as tl


@triton.jit
def _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b, new_tokens, table, head_base,
                 d, k_cache_ptr, v_cache_ptr, new_mask_ptr, scale_log2, page_stride, page_size, cache_pos_stride,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update with the keys ``key0 .. key0 + BLOCK_N - 1`` (those before ``stop``),
    each read from the page the slot's block table (``table``) maps its position to."""
    j = key0 + tl.arange(0, BLOCK_N)  # [N]
    in_range = j < stop
    s, v = _paged_scores(q, j, in_range, table, head_base, d, k_cache_ptr, v_cache_ptr, page_stride, page_size,
                         cache_pos_stride, IEEE)
    s = s * scale_log2  # [M, N], base-2 logits
    new = j - committed  # index among the new tokens (negative: committed context)
    tree = tl.load(new_mask_ptr + (b * new_tokens + token)[:, None].to(tl.int64) * new_tokens + new[None, :],
                   mask=valid_q[:, None] & (new[None, :] >= 0) & in_range[None, :], other=0)
    visible = in_range[None, :] & tl.where(new[None, :] < 0, j[None, :] >= oldest, tree != 0)
    return _online_softmax_step(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc, IEEE)


@triton.jit
def _attend_context(q, m_i, l_i, acc, key0, oldest, table, head_base, d, k_cache_ptr, v_cache_ptr, scale_log2,
                    page_stride, page_size, cache_pos_stride, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update with the committed keys ``key0 .. key0 + BLOCK_N - 1`` (all in range, no tree mask:
    every query sees them, except those a sliding window hides: before ``oldest``)."""
    j = key0 + tl.arange(0, BLOCK_N)  # [N]
    s, v = _paged_scores(q, j, j >= 0, table, head_base, d, k_cache_ptr, v_cache_ptr, page_stride, page_size,
                         cache_pos_stride, IEEE, MASKED=False)
    s = tl.where(j[None, :] >= oldest, s * scale_log2, float("-inf"))  # [M, N], base-2 logits
    return _online_softmax_step(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def _paged_scores(q, position, in_range, table, head_base, d, k_cache_ptr, v_cache_ptr, page_stride, page_size,
                  cache_pos_stride, IEEE: tl.constexpr, MASKED: tl.constexpr = True):
    """The entries at slot positions ``position`` [N] (those ``in_range``; all when not MASKED), read through the
    slot's block table (``table``): (q . k logits [M, N], values [N, D])."""
    if MASKED:
        page = tl.load(table + position // page_size, mask=in_range, other=0).to(tl.int64)  # [N]
    else:
        page = tl.load(table + position // page_size).to(tl.int64)
    entry = page * page_stride + (position % page_size).to(tl.int64) * cache_pos_stride + head_base  # [N]
    kv_off = entry[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        v = tl.load(v_cache_ptr + kv_off, mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_off)
    return s, v


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold a block of base-2 logits ``s`` [M, N] (-inf: not visible) and its values ``v`` [N, D] into the
    running max ``m_i``, sum ``l_i`` and output ``acc``; returns the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, slots_ptr, lengths_ptr, new_mask_ptr, counts_ptr, out_ptr, lse_ptr,
        new_tokens, heads, kv_heads, window, scale_log2, table_stride, page_size,
        cache_page_stride, cache_head_stride, cache_pos_stride,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """One (tile of query (token, head) pairs, row and kv head, key split): online softmax over the
    split's keys. Queries of the GROUP heads sharing a kv head are packed as r = token * GROUP + g. The
    query tiles of one (row, kv head) are neighbours in the grid, so they read its keys while L2 holds them.
    HAS_COUNTS: only the first ``counts[b]`` new tokens of row b are real (a packed forward's rows); no key
    past them is read, and a tile holding none of them reads no key at all (its outputs are zeros)."""
    pid_bh = tl.program_id(1)
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    split = tl.program_id(2)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    token = r // GROUP
    head = kv_head * GROUP + r % GROUP
    valid_q = token < new_tokens
    d = tl.arange(0, HEAD_DIM)
    q_rows = ((b * heads + head) * new_tokens + token).to(tl.int64) * HEAD_DIM  # q, out: [B, H, N, D]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid_q[:, None], other=0.0)

    committed = tl.load(lengths_ptr + b)
    seen_new = new_tokens  # new tokens whose keys a query of this tile may see
    if HAS_COUNTS:
        seen_new = tl.minimum(tl.load(counts_ptr + b), new_tokens)
        seen_new = tl.where(tl.program_id(0) * BLOCK_M // GROUP < seen_new, seen_new, -committed)  # (none real: none)
    total = committed + seen_new  # keys of this row: committed context, then the new tokens
    chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    stop = tl.minimum(start + chunk, total)
    oldest = tl.where(window > 0, committed - window, 0)  # a sliding window hides older context
    table = table_ptr + tl.load(slots_ptr + b).to(tl.int64) * table_stride  # the row's block table
    head_base = kv_head.to(tl.int64) * cache_head_stride

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # whole blocks of committed context first (no tree mask, no range checks), then the rest with both
    context_end = start + tl.maximum(tl.minimum(stop, committed) - start, 0) // BLOCK_N * BLOCK_N
    if INTERPRET:  # the interpreter cannot take loaded values as range() bounds
        key0 = start
        while key0 < context_end:
            m_i, l_i, acc = _attend_context(q, m_i, l_i, acc, key0, oldest, table, head_base, d, k_cache_ptr,
                                            v_cache_ptr, scale_log2, cache_page_stride, page_size, cache_pos_stride,
                                            BLOCK_N, IEEE)
            key0 += BLOCK_N
        while key0 < stop:
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b,
                                         new_tokens, table, head_base, d, k_cache_ptr, v_cache_ptr, new_mask_ptr,
                                         scale_log2, cache_page_stride, page_size, cache_pos_stride, BLOCK_N, IEEE)
            key0 += BLOCK_N
    else:
        for key0 in range(start, context_end, BLOCK_N):
            m_i, l_i, acc = _attend_context(q, m_i, l_i, acc, key0, oldest, table, head_base, d, k_cache_ptr,
                                            v_cache_ptr, scale_log2, cache_page_stride, page_size, cache_pos_stride,
                                            BLOCK_N, IEEE)
        for key0 in range(context_end, stop, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b,
                                         new_tokens, table, head_base, d, k_cache_ptr, v_cache_ptr, new_mask_ptr,
                                         scale_log2, cache_page_stride, page_size, cache_pos_stride, BLOCK_N, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid_q[:, None])
    else:  # partial result and its log-sum-exp; _combine_splits_kernel merges the splits
        part = ((b * heads + head) * new_tokens + token).to(tl.int64) * SPLITS + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=valid_q[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=valid_q)


@triton.jit
def _combine_splits_kernel(part_ptr, lse_ptr, out_ptr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[row] = sum_s w_s * part[row, s] with w_s proportional to 2^lse_s (one query row per program)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * SPLITS + s)  # [S]
    top = tl.max(lse, axis=0)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    parts = tl.load(part_ptr + (row * SPLITS + s)[:, None] * HEAD_DIM + d[None, :])  # [S, D]
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # (no key in any split: zeros)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _attend_logical_keys(q, m_i, l_i, acc, key0, stop, rows, committed, order_token, new_tokens, b, table,
                         head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2, page_stride, page_size,
                         cache_pos_stride, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update of the query rows ``rows`` [M] with the logical keys ``key0 .. key0 + BLOCK_N - 1``
    (for each row those before its ``stop`` [M]); the other rows' state is left as it is (their logits are -inf:
    the update adds exact zeros). Logical key j < ``committed`` is cache position j; the others are an ancestor
    at depth j - committed of token ``order_token``, whose entry sits at ``committed`` + its index among the new
    tokens (``order``; the index is the depth when CAUSAL, the same for every token of a chain)."""
    logical = key0 + tl.arange(0, BLOCK_N)  # [N]
    in_range = logical < tl.max(tl.where(rows, stop, 0), axis=0)  # [N] keys some updated row sees
    depth_of = logical - committed
    if CAUSAL:
        new_index = depth_of
    else:
        new_index = tl.load(order_ptr + (b * new_tokens + order_token).to(tl.int64) * new_tokens + depth_of,
                            mask=in_range & (depth_of >= 0), other=0)
    position = tl.where(depth_of >= 0, committed + new_index, logical)  # [N] where each entry sits in the slot
    s, v = _paged_scores(q, position, in_range, table, head_base, d, k_cache_ptr, v_cache_ptr, page_stride,
                         page_size, cache_pos_stride, IEEE)
    visible = rows[:, None] & (logical[None, :] < stop[:, None])  # [M, N]
    s = tl.where(visible, s * scale_log2, float("-inf"))  # base-2 logits
    return _online_softmax_step(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def _attend_block(q, m_i, l_i, acc, key0, stop, valid, t_local, token0, committed, new_tokens, b, table, head_base,
                  d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2, page_stride, page_size, cache_pos_stride,
                  BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """One block of logical keys for the tile's tokens: in one pass where every token reads the same entries (a
    chain's tokens, or a block of committed context), else one pass per token (a tree's tokens past the
    committed context see their own ancestors)."""
    if CAUSAL:
        m_i, l_i, acc = _attend_logical_keys(q, m_i, l_i, acc, key0, stop, valid, committed, token0, new_tokens, b,
                                             table, head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2,
                                             page_stride, page_size, cache_pos_stride, BLOCK_N, CAUSAL, IEEE)
    elif key0 + BLOCK_N <= committed:
        m_i, l_i, acc = _attend_logical_keys(q, m_i, l_i, acc, key0, stop, valid, committed, token0, new_tokens, b,
                                             table, head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2,
                                             page_stride, page_size, cache_pos_stride, BLOCK_N, CAUSAL, IEEE)
    else:
        for j in tl.static_range(TOKENS):
            m_i, l_i, acc = _attend_logical_keys(q, m_i, l_i, acc, key0, stop, valid & (t_local == j), committed,
                                                 tl.minimum(token0 + j, new_tokens - 1), new_tokens, b, table,
                                                 head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2,
                                                 page_stride, page_size, cache_pos_stride, BLOCK_N, CAUSAL, IEEE)
    return m_i, l_i, acc


@triton.jit
def _split_partial(q, split, chunk, total, valid, t_local, token0, committed, new_tokens, b, table, head_base, d,
                   k_cache_ptr, v_cache_ptr, order_ptr, scale_log2, page_stride, page_size, cache_pos_stride,
                   BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
                   CAUSAL: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One split's result for each query row: softmax attention over its logical keys
    ``split * chunk .. min(+chunk, total) - 1`` in blocks of BLOCK_N from the split's start -> (output ``[M, D]``
    float32, base-2 log-sum-exp ``[M]``, -inf where the row has no key in the split)."""
    start = split * chunk
    stop = tl.minimum(start + chunk, total)  # [M]
    tile_stop = tl.max(tl.where(valid, stop, start), axis=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if INTERPRET:  # the interpreter cannot take loaded values as range() bounds
        key0 = start
        while key0 < tile_stop:
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, key0, stop, valid, t_local, token0, committed,
                                          new_tokens, b, table, head_base, d, k_cache_ptr, v_cache_ptr, order_ptr,
                                          scale_log2, page_stride, page_size, cache_pos_stride, BLOCK_N, TOKENS,
                                          CAUSAL, IEEE)
            key0 += BLOCK_N
    else:
        for key0 in range(start, tile_stop, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, key0, stop, valid, t_local, token0, committed,
                                          new_tokens, b, table, head_base, d, k_cache_ptr, v_cache_ptr, order_ptr,
                                          scale_log2, page_stride, page_size, cache_pos_stride, BLOCK_N, TOKENS,
                                          CAUSAL, IEEE)
    part = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    return part, lse


@triton.jit
def _merge_split(top, total_out, weight, part, lse):
    """Fold one split (``part`` [M, D], ``lse`` [M]) into the running merge (max log-sum-exp ``top``, weighted
    sum ``total_out``, sum of weights ``weight``): the one merge formula both exact kernels use, in split order."""
    new_top = tl.maximum(top, lse)
    base = tl.where(new_top == float("-inf"), 0.0, new_top)  # (padding rows: nothing merged yet, nor now)
    old_scale = tl.exp2(top - base)
    scale = tl.exp2(lse - base)
    total_out = total_out * old_scale[:, None] + part * scale[:, None]
    weight = weight * old_scale + scale
    return new_top, total_out, weight


@triton.jit
def _exact_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, slots_ptr, lengths_ptr, order_ptr, depth_ptr, out_ptr, part_ptr,
        lse_ptr, new_tokens, heads, kv_heads, scale_log2, table_stride, page_size, chunk, max_splits,
        cache_page_stride, cache_head_stride, cache_pos_stride,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PARALLEL: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
        INTERPRET: tl.constexpr):
    """The GROUP query heads of TOKENS = BLOCK_M / GROUP_PAD new tokens of one (row, kv head), each token over
    the logical keys it sees (committed context, then its ancestors by depth), split in runs of ``chunk``
    logical keys. PARALLEL: this program does split ``program_id(2)`` and stores each query row's result and
    log-sum-exp (-inf for a split past its keys) for :func:`_merge_splits_kernel`; else it does every split in
    order and merges them itself, with the same formula (:func:`_merge_split`). Either way a query row's
    arithmetic depends only on its logical keys: a row's tile neighbours only add exact zeros to its state."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP_PAD
    pid_bh = tl.program_id(1)  # the tiles of one (row, kv head) run side by side: its keys stay in L2
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    token0 = tl.program_id(0) * TOKENS
    r = tl.arange(0, BLOCK_M)  # [M] query rows: token t_local, head g of this kv head's group
    t_local = r // GROUP_PAD
    g = r % GROUP_PAD
    token = token0 + t_local
    valid = (g < GROUP) & (token < new_tokens)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_rows = ((b * heads + head) * new_tokens + token).to(tl.int64)  # q, out: [B, H, N, D]
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    committed = tl.load(lengths_ptr + b)
    if CAUSAL:
        depth = token
    else:
        depth = tl.load(depth_ptr + b * new_tokens + token, mask=valid, other=0)
    total = committed + depth + 1  # [M] each row sees logical keys 0 .. committed + depth
    table = table_ptr + tl.load(slots_ptr + b).to(tl.int64) * table_stride
    head_base = kv_head.to(tl.int64) * cache_head_stride
    if PARALLEL:
        split = tl.program_id(2)
        part, lse = _split_partial(q, split, chunk, total, valid, t_local, token0, committed, new_tokens, b, table,
                                   head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2, cache_page_stride,
                                   page_size, cache_pos_stride, BLOCK_M, HEAD_DIM, BLOCK_N, TOKENS, CAUSAL, IEEE,
                                   INTERPRET)
        slot = q_rows * max_splits + split
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], part, mask=valid[:, None])
        tl.store(lse_ptr + slot, lse, mask=valid)
    else:
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total_out = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        weight = tl.zeros([BLOCK_M], tl.float32)
        tile_total = tl.max(tl.where(valid, total, 0), axis=0)
        split = 0
        while split * chunk < tile_total:  # a row past its last split merges exact no-ops (lse -inf)
            part, lse = _split_partial(q, split, chunk, total, valid, t_local, token0, committed, new_tokens, b,
                                       table, head_base, d, k_cache_ptr, v_cache_ptr, order_ptr, scale_log2,
                                       cache_page_stride, page_size, cache_pos_stride, BLOCK_M, HEAD_DIM, BLOCK_N,
                                       TOKENS, CAUSAL, IEEE, INTERPRET)
            top, total_out, weight = _merge_split(top, total_out, weight, part, lse)
            split += 1
        out = total_out / tl.where(weight > 0, weight, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None])


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, max_splits, HEAD_DIM: tl.constexpr):
    """The PARALLEL exact attention's splits of one query row merged in split order (empty splits skipped)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    top = tl.full([1], float("-inf"), tl.float32)
    total_out = tl.zeros([1, HEAD_DIM], tl.float32)
    weight = tl.zeros([1], tl.float32)
    split = 0
    lse = tl.load(lse_ptr + row * max_splits + split + tl.zeros([1], tl.int64))
    while (split < max_splits) & (tl.max(lse, axis=0) > float("-inf")):
        part = tl.load(part_ptr + (row * max_splits + split) * HEAD_DIM + d)[None, :]  # [1, D]
        top, total_out, weight = _merge_split(top, total_out, weight, part, lse)
        split += 1
        nxt = split + tl.zeros([1], tl.int64)
        lse = tl.load(lse_ptr + row * max_splits + nxt, mask=nxt < max_splits, other=float("-inf"))
    out = total_out / weight[:, None]
    tl.store(out_ptr + row * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty))
