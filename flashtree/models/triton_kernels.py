"""The Triton kernels behind :mod:`flashtree.models.gpu_kernels` (imported only when used, so
CPU-only runs never import Triton). Every program handles one token (and one head, or one
column block); arithmetic is float32 with one rounding to the output dtype."""

import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, sum_ptr, normed_ptr, width, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * width + cols, total, mask=inside)
    s = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * width + cols, (s * inv_rms * w).to(normed_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _qkv_norm_rope_write_kernel(
        qkv_ptr, qk_norm_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, cache_pos_ptr,
        q_out_ptr, k_cache_ptr, v_cache_ptr,
        new_tokens, heads, kv_heads, eps,
        cache_slot_stride, cache_head_stride, cache_pos_stride,
        HALF: tl.constexpr, QK_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # flat index b * N + n
    head = tl.program_id(1)  # 0..H-1: a query head; H..H+KVH-1: a key/value head
    half = tl.arange(0, HALF)
    width = (heads + 2 * kv_heads) * 2 * HALF
    base = qkv_ptr + token * width + head * 2 * HALF
    lo = tl.load(base + half).to(tl.float32)
    hi = tl.load(base + HALF + half).to(tl.float32)
    if QK_NORM:
        norm_ptr = qk_norm_ptr + (head >= heads).to(tl.int64) * 2 * HALF  # row 0: q's weight, row 1: k's
        inv_rms = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
        lo = (lo * inv_rms * tl.load(norm_ptr + half).to(tl.float32))
        hi = (hi * inv_rms * tl.load(norm_ptr + HALF + half).to(tl.float32))
        lo = lo.to(q_out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds the normed q/k
        hi = hi.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * 2 * HALF + half).to(tl.float32)
    sin = tl.load(sin_ptr + position * 2 * HALF + half).to(tl.float32)
    rot_lo = lo * cos - hi * sin
    rot_hi = hi * cos + lo * sin
    if head < heads:
        b = token // new_tokens
        n = token % new_tokens
        out = q_out_ptr + ((b * heads + head) * new_tokens + n) * 2 * HALF
        tl.store(out + half, rot_lo.to(q_out_ptr.dtype.element_ty))
        tl.store(out + HALF + half, rot_hi.to(q_out_ptr.dtype.element_ty))
    else:
        kv_head = head - heads
        entry = (tl.load(slots_ptr + token) * cache_slot_stride + kv_head * cache_head_stride
                 + tl.load(cache_pos_ptr + token) * cache_pos_stride)
        tl.store(k_cache_ptr + entry + half, rot_lo.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + entry + HALF + half, rot_hi.to(k_cache_ptr.dtype.element_ty))
        v_base = qkv_ptr + token * width + (heads + kv_heads + kv_head) * 2 * HALF
        tl.store(v_cache_ptr + entry + half, tl.load(v_base + half))
        tl.store(v_cache_ptr + entry + HALF + half, tl.load(v_base + HALF + half))


@triton.jit
def _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b, new_tokens, base, d,
                 k_cache_ptr, v_cache_ptr, new_mask_ptr, scale_log2, cache_pos_stride,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update with the keys ``key0 .. key0 + BLOCK_N - 1`` (those before ``stop``)."""
    j = key0 + tl.arange(0, BLOCK_N)  # [N]
    in_range = j < stop
    kv_off = base + j.to(tl.int64)[:, None] * cache_pos_stride + d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=in_range[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2  # [M, N], base-2 logits
    new = j - committed  # index among the new tokens (negative: committed context)
    tree = tl.load(new_mask_ptr + (b * new_tokens + token)[:, None].to(tl.int64) * new_tokens + new[None, :],
                   mask=valid_q[:, None] & (new[None, :] >= 0) & in_range[None, :], other=0)
    visible = in_range[None, :] & tl.where(new[None, :] < 0, j[None, :] >= oldest, tree != 0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=in_range[:, None], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, lengths_ptr, new_mask_ptr, out_ptr, lse_ptr,
        new_tokens, heads, kv_heads, window, scale_log2,
        cache_slot_stride, cache_head_stride, cache_pos_stride,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One (row, kv head, tile of query (token, head) pairs, key split): online softmax over the
    split's keys. Queries of the GROUP heads sharing a kv head are packed as r = token * GROUP + g."""
    pid_bh = tl.program_id(0)
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    split = tl.program_id(2)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    token = r // GROUP
    head = kv_head * GROUP + r % GROUP
    valid_q = token < new_tokens
    d = tl.arange(0, HEAD_DIM)
    q_rows = ((b * heads + head) * new_tokens + token).to(tl.int64) * HEAD_DIM  # q, out: [B, H, N, D]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid_q[:, None], other=0.0)

    committed = tl.load(lengths_ptr + b)
    total = committed + new_tokens  # keys of this row: committed context, then the new tokens
    chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    stop = tl.minimum(start + chunk, total)
    oldest = tl.where(window > 0, committed - window, 0)  # a sliding window hides older context
    base = tl.load(slots_ptr + b).to(tl.int64) * cache_slot_stride + kv_head * cache_head_stride

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if INTERPRET:  # the interpreter cannot take loaded values as range() bounds
        key0 = start
        while key0 < stop:
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b,
                                         new_tokens, base, d, k_cache_ptr, v_cache_ptr, new_mask_ptr, scale_log2,
                                         cache_pos_stride, BLOCK_N, IEEE)
            key0 += BLOCK_N
    else:
        for key0 in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, stop, committed, oldest, token, valid_q, b,
                                         new_tokens, base, d, k_cache_ptr, v_cache_ptr, new_mask_ptr, scale_log2,
                                         cache_pos_stride, BLOCK_N, IEEE)

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
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _count_at_least(w, lp_ptr, t, k, rows_ok, STRICT: tl.constexpr, LOG_K: tl.constexpr):
    """Per kept prefix i: how many of its children w_i + l_j (non-increasing in j) are >= t
    (> t when STRICT), found by binary search over j in [0, k)."""
    lo = tl.zeros_like(w).to(tl.int32)
    hi = tl.zeros_like(w).to(tl.int32) + k
    for _ in range(LOG_K):
        mid = (lo + hi) // 2
        v = w + tl.load(lp_ptr + mid, mask=rows_ok & (mid < k), other=float("-inf"))
        above = (v > t) if STRICT else (v >= t)
        go_right = above & (mid < hi)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return tl.where(rows_ok, lo, 0)


@triton.jit
def _expand_levels_kernel(logp_ptr, tokens_ptr, w_out_ptr, parent_out_ptr, token_out_ptr, index_scratch_ptr,
                          weight_scratch_ptr, k, budget, DEPTH: tl.constexpr, BLOCK_B: tl.constexpr,
                          LOG_K: tl.constexpr, LOG_B: tl.constexpr):
    """One row's kept lists for every depth (tree.py ``_expand_levels``, exactly): depth d keeps
    the ``budget`` best of the [budget, k] matrix w_i + l_j, ties to the lower flat index (i, j).

    Children of kept prefix i are non-increasing in j (l is sorted and float rounding is
    monotone), so everything is counted per row by binary search: the budget-th best weight T by
    bisection over float32 order, then row i keeps its first a_i + take_i children (a_i above T,
    take_i of its ties at T, handed out in row order), laid out in (i, j) order."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_B)
    rows_ok = i < budget
    lp_row = logp_ptr + row * DEPTH * k
    tok_row = tokens_ptr + row * DEPTH * k
    out = row * DEPTH * budget
    scratch = index_scratch_ptr + row * 2 * BLOCK_B  # [2, BLOCK_B] int32: row ends, row starts
    weights = weight_scratch_ptr + row * BLOCK_B  # [BLOCK_B] float32: the kept weights
    first = rows_ok & (i < k)
    w = tl.load(lp_row + i, mask=first, other=float("-inf"))  # depth 1: the top tokens themselves
    tl.store(w_out_ptr + out + i, w, mask=rows_ok)
    tl.store(parent_out_ptr + out + i, tl.zeros_like(i).to(tl.int64), mask=rows_ok)
    tl.store(token_out_ptr + out + i, tl.load(tok_row + i, mask=first, other=0), mask=rows_ok)
    for d in range(1, DEPTH):
        lp = lp_row + d * k
        # T: the largest float32 (as an ordered key) with at least `budget` children >= T
        lo_key = tl.full([], -2139095041, tl.int64)  # key of -inf (bits 0xFF800000)
        hi_key = tl.full([], 2139095040, tl.int64)  # key of +inf (bits 0x7F800000)
        for _ in range(32):
            mid = lo_key + (hi_key - lo_key + 1) // 2
            bits = tl.where(mid >= 0, mid, mid ^ 0x7FFFFFFF).to(tl.int32)
            t = bits.to(tl.float32, bitcast=True)
            enough = tl.sum(_count_at_least(w, lp, t, k, rows_ok, False, LOG_K), axis=0) >= budget
            lo_key = tl.where(enough, mid, lo_key)
            hi_key = tl.where(enough, hi_key, mid - 1)
        threshold = tl.where(lo_key >= 0, lo_key, lo_key ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        above = _count_at_least(w, lp, threshold, k, rows_ok, True, LOG_K)  # [BLOCK_B]
        ties = _count_at_least(w, lp, threshold, k, rows_ok, False, LOG_K) - above
        need = budget - tl.sum(above, axis=0)
        ties_before = tl.cumsum(ties, axis=0) - ties
        kept = above + tl.minimum(tl.maximum(need - ties_before, 0), ties)  # children kept per row
        ends = tl.cumsum(kept, axis=0)
        tl.store(scratch + i, ends)
        tl.store(scratch + BLOCK_B + i, ends - kept)
        tl.store(weights + i, w)
        tl.debug_barrier()
        # output slot o belongs to the first row whose end is past o
        lo = tl.zeros_like(i)
        hi = tl.zeros_like(i) + budget
        for _ in range(LOG_B):
            mid = (lo + hi) // 2
            past = tl.load(scratch + mid, mask=rows_ok & (mid < budget), other=0) > i
            go_right = (~past) & (mid < hi)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        parent = tl.minimum(lo, budget - 1)
        child = i - tl.load(scratch + BLOCK_B + parent, mask=rows_ok, other=0)
        w = tl.load(weights + parent, mask=rows_ok, other=float("-inf")) + \
            tl.load(lp + child, mask=rows_ok, other=float("-inf"))
        w = tl.where(rows_ok, w, float("-inf"))
        tl.debug_barrier()
        level = out + d * budget
        tl.store(w_out_ptr + level + i, w, mask=rows_ok)
        tl.store(parent_out_ptr + level + i, parent.to(tl.int64), mask=rows_ok)
        tl.store(token_out_ptr + level + i, tl.load(tok_row + d * k + child, mask=rows_ok, other=0), mask=rows_ok)
