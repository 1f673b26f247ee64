"""Triton kernels of DDTree's tree work (behind :mod:`flashtree.kernels.gpu.tree`): per-depth kept lists, node
selection with the ancestor mask, the accept walk, and the KV commit of the accepted path. One program per row."""

import triton
import triton.language as tl


@triton.jit
def _children_above_and_at(w, lp_ptr, t, k, rows_ok, LOG_K: tl.constexpr):
    """Per kept prefix i: how many of its children w_i + l_j (non-increasing in j) are > t, and how
    many are >= t. Two binary searches over j in [0, k), run in the same steps so that their loads
    overlap."""
    lo_above = tl.zeros_like(w).to(tl.int32)
    hi_above = lo_above + k
    lo_at = lo_above
    hi_at = hi_above
    for _ in range(LOG_K):
        mid_above = (lo_above + hi_above) // 2
        mid_at = (lo_at + hi_at) // 2
        v_above = w + tl.load(lp_ptr + mid_above, mask=rows_ok & (mid_above < k), other=float("-inf"))
        v_at = w + tl.load(lp_ptr + mid_at, mask=rows_ok & (mid_at < k), other=float("-inf"))
        right_above = (v_above > t) & (mid_above < hi_above)
        right_at = (v_at >= t) & (mid_at < hi_at)
        lo_above = tl.where(right_above, mid_above + 1, lo_above)
        hi_above = tl.where(right_above, hi_above, mid_above)
        lo_at = tl.where(right_at, mid_at + 1, lo_at)
        hi_at = tl.where(right_at, hi_at, mid_at)
    return tl.where(rows_ok, lo_above, 0), tl.where(rows_ok, lo_at, 0)


@triton.jit
def _key_of_float(x):
    """A float32's order key (int64): keys compare as the floats do (-0.0 sits just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _float_of_key(key):
    """The float32 whose order key (see :func:`_key_of_float`) is ``key``."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


CLOCK_STAGES = tl.constexpr(8)  # stage clock slots per program (the tree kernels' CLOCKS option)


@triton.jit
def _clock():
    """The SM's cycle counter (CUDA only; the tree kernels' CLOCKS option times their stages with it)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [tl.zeros([], tl.int32)],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _lap(spent, last, STAGE: tl.constexpr):
    """Adds the cycles since ``last`` to ``spent[STAGE]`` ([CLOCK_STAGES] int64); returns the new
    ``spent`` and the time."""
    now = _clock()
    return spent + tl.where(tl.arange(0, CLOCK_STAGES) == STAGE, now - last, 0), now


@triton.jit
def _kth_largest(values, count, lower):
    """The ``count``-th largest of ``values`` (float32, no NaN), given ``lower``: a float32 that at
    least ``count`` values reach (so the answer is >= it). :func:`_narrow_to` run to the end."""
    answer, _ = _narrow_to(values, count, lower, 0)
    return answer


SEARCH_SORT = tl.constexpr(0)  # the kept-list kernel's threshold searches (see _expand_levels_kernel)
SEARCH_BISECT = tl.constexpr(1)
SEARCH_NARROW = tl.constexpr(2)


@triton.jit
def _store_sorted(sorted_ptr, w, rows_ok):
    """The kept weights ``w`` [BLOCK_B], sorted descending (-inf past the budget), to ``sorted_ptr``."""
    tl.store(sorted_ptr + tl.arange(0, w.shape[0]), tl.sort(tl.where(rows_ok, w, float("-inf")), 0, descending=True))
    tl.debug_barrier()


@triton.jit
def _narrow_to(values, count, lower, MOST: tl.constexpr):
    """Bisection over float32 order keys for the ``count``-th largest of ``values`` (float32, no
    NaN), from ``lower`` (a float32 that at least ``count`` values reach, so the answer is >= it) to
    the largest value, one count per step with the values in registers: the answer is the largest
    key that ``count`` values reach, and ``lo`` stays at or below it. A tight ``lower`` saves steps
    (32 for the whole float32 range). With MOST > 0 it stops as soon as at most MOST values reach
    ``lo``. Returns ``lo`` as a float32 and the number of values reaching it (MOST = 0: ``count``,
    not counted, and ``lo`` is the answer; so it is also when the number is still above MOST)."""
    lo = _key_of_float(lower)
    hi = _key_of_float(tl.max(values, axis=0))
    if MOST > 0:
        reaching = tl.sum((values >= lower).to(tl.int32), axis=0)
    else:
        reaching = count + tl.zeros([], tl.int32)  # (count >= 1 > MOST: the loop runs to the end)
    while (lo < hi) & (reaching > MOST):
        mid = lo + (hi - lo + 1) // 2
        at_mid = tl.sum((values >= _float_of_key(mid)).to(tl.int32), axis=0)
        enough = at_mid >= count
        lo = tl.where(enough, mid, lo)
        reaching = tl.where(enough, at_mid, reaching)
        hi = tl.where(enough, hi, mid - 1)
    return _float_of_key(lo), reaching


@triton.jit
def _sorted_from_gathered(values, cut, reaching, count, gathered_ptr, sorted_ptr, MOST: tl.constexpr):
    """The ``count``-th largest of ``values``, given ``cut``: at least ``count`` and at most MOST of
    them reach it. Gathers those ``reaching`` values to ``gathered_ptr``, sorts them (descending) and
    stores the first ``count`` to ``sorted_ptr``; the caller's reads of ``sorted_ptr`` must be done."""
    keep = values >= cut
    place = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(gathered_ptr + place, values, mask=keep)
    tl.debug_barrier()
    n = tl.arange(0, MOST)
    ordered = tl.sort(tl.load(gathered_ptr + n, mask=n < reaching, other=float("-inf")), 0, descending=True)
    tl.store(sorted_ptr + n, ordered, mask=n < count)
    tl.debug_barrier()
    return tl.max(tl.where(n == count - 1, ordered, float("-inf")), axis=0)


@triton.jit
def _expand_levels_kernel(logp_ptr, tokens_ptr, pair_row_ptr, pair_rank_ptr, w_out_ptr, parent_out_ptr,
                          token_out_ptr, index_scratch_ptr, weight_scratch_ptr, clocks_ptr, k, budget, pairs,
                          DEPTH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
                          LOG_K: tl.constexpr, SEARCH: tl.constexpr, NARROW: tl.constexpr, CLOCKS: tl.constexpr):
    """One row's kept lists for every depth (tree.py ``_expand_levels``, exactly): depth d keeps
    the ``budget`` best of the [budget, k] matrix w_i + l_j, ties to the lower flat index (i, j).

    The budget-th best weight T is the budget-th of the prefilter list (the ``pairs`` (row, rank)
    pairs of tree.py ``_prefilter_pairs`` over the kept weights sorted descending, s), found one of
    three ways (SEARCH; all give the same T):
    - SEARCH_SORT (short lists): one sort of the list gives T, and its first ``budget`` entries are
      the next depth's sorted weights;
    - SEARCH_BISECT: a bisection over float32 order keys with the list held in registers
      (:func:`_kth_largest`), after one sort of the kept weights. It starts from a lower bound:
      s_i + l_c with c = ceil(budget / (i + 1)) - 1 heads a rectangle of (i + 1)(c + 1) >= budget
      matrix entries that are all >= it (rows and columns are sorted and float rounding is monotone);
    - SEARCH_NARROW: the same bisection from the same lower bound, but only until at most NARROW
      list entries reach its low end (:func:`_narrow_to`; usually no step at all); those entries
      are then gathered (their order does not matter) and sorted, which gives T and, as their first
      ``budget``, the next depth's sorted weights, so that depth skips its sort of the kept weights.
      Where ties keep more than NARROW entries at the answer, the bisection runs to the end and the
      next depth sorts its kept weights as SEARCH_BISECT does.
    Children of kept prefix i are non-increasing in j, so row i keeps its first a_i + take_i
    children (a_i above T, take_i of its ties at T, handed out in row order; both counted by
    binary search), laid out in (i, j) order. Output slot o belongs to the last row with children
    kept whose first slot is at or before o: each such row marks its first slot (with the depth
    in the mark, so older marks are smaller) and a running maximum over the slots reads the owner.
    CLOCKS: SM cycles per stage, summed over depths, to ``clocks_ptr`` [R, CLOCK_STAGES]: sort of the
    kept weights, candidates, threshold, counts, slot owners, new weights and stores (SEARCH_NARROW:
    its gather and sort count as the threshold)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_B)
    rows_ok = i < budget
    m = tl.arange(0, BLOCK_M)
    pairs_ok = m < pairs
    pair_row = tl.load(pair_row_ptr + m, mask=pairs_ok, other=0)  # [BLOCK_M] int32
    pair_rank = tl.load(pair_rank_ptr + m, mask=pairs_ok, other=0)  # [BLOCK_M] int32
    lp_row = logp_ptr + row * DEPTH * k
    tok_row = tokens_ptr + row * DEPTH * k
    out = row * DEPTH * budget
    marks = index_scratch_ptr + row * 2 * BLOCK_B  # [BLOCK_B] int32: row marks at their first slot
    starts_at = marks + BLOCK_B  # [BLOCK_B] int32: each row's first slot
    weights = weight_scratch_ptr + row * (2 * BLOCK_B + NARROW)  # [BLOCK_B] float32: the kept weights
    sorted_w = weights + BLOCK_B  # [BLOCK_B] float32: the kept weights, descending
    gathered = sorted_w + BLOCK_B  # [NARROW] float32 (SEARCH_NARROW): the list entries at or above its cut
    first = rows_ok & (i < k)
    w = tl.load(lp_row + i, mask=first, other=float("-inf"))  # depth 1: the top tokens themselves
    tl.store(w_out_ptr + out + i, w, mask=rows_ok)
    tl.store(parent_out_ptr + out + i, tl.zeros_like(i).to(tl.int64), mask=rows_ok)
    tl.store(token_out_ptr + out + i, tl.load(tok_row + i, mask=first, other=0), mask=rows_ok)
    tl.store(marks + i, tl.full(i.shape, -1, tl.int32))  # no marks yet
    if SEARCH != SEARCH_BISECT:
        tl.store(sorted_w + i, w, mask=rows_ok)  # (depth 1's weights are already descending)
    unsorted = tl.zeros([], tl.int32)  # SEARCH_NARROW: 1 when sorted_w does not hold this depth's kept weights
    tl.debug_barrier()
    corner = (budget + i) // (i + 1) - 1  # [BLOCK_B] c_i of the lower bound
    corner_ok = rows_ok & (corner < k)
    if CLOCKS:
        spent, last = tl.zeros([CLOCK_STAGES], tl.int64), _clock()
    for d in range(1, DEPTH):
        lp = lp_row + d * k
        if SEARCH == SEARCH_BISECT:
            _store_sorted(sorted_w, w, rows_ok)
        if SEARCH == SEARCH_NARROW:
            if unsorted:
                _store_sorted(sorted_w, w, rows_ok)
        if SEARCH != SEARCH_SORT:
            s = tl.load(sorted_w + i, mask=rows_ok, other=float("-inf"))  # [BLOCK_B]
            lower = tl.max(tl.where(corner_ok, s + tl.load(lp + corner, mask=corner_ok, other=float("-inf")),
                                    float("-inf")), axis=0)
        if CLOCKS:
            spent, last = _lap(spent, last, 0)
        candidates = tl.load(sorted_w + pair_row, mask=pairs_ok, other=float("-inf")) + \
            tl.load(lp + pair_rank, mask=pairs_ok, other=float("-inf"))  # [BLOCK_M]
        candidates = tl.where(pairs_ok, candidates, float("-inf"))
        if CLOCKS:
            spent, last = _lap(spent, last, 1)
        if SEARCH == SEARCH_SORT:
            ordered = tl.sort(candidates, 0, descending=True)  # [BLOCK_M]
            threshold = tl.max(tl.where(m == budget - 1, ordered, float("-inf")), axis=0)
            tl.debug_barrier()  # every read of sorted_w is done
            tl.store(sorted_w + m, ordered, mask=m < budget)
        elif SEARCH == SEARCH_BISECT:
            threshold = _kth_largest(candidates, budget, lower)
        else:
            cut, reaching = _narrow_to(candidates, budget, lower, NARROW)
            threshold = cut
            unsorted = (reaching > NARROW).to(tl.int32)
            if reaching <= NARROW:
                threshold = _sorted_from_gathered(candidates, cut, reaching, budget, gathered, sorted_w, NARROW)
        if CLOCKS:
            spent, last = _lap(spent, last, 2)
        above, at_least = _children_above_and_at(w, lp, threshold, k, rows_ok, LOG_K)  # [BLOCK_B] x2
        ties = at_least - above
        need = budget - tl.sum(above, axis=0)
        ties_before = tl.cumsum(ties, axis=0) - ties
        kept = above + tl.minimum(tl.maximum(need - ties_before, 0), ties)  # children kept per row
        if CLOCKS:
            spent, last = _lap(spent, last, 3)
        starts = tl.cumsum(kept, axis=0) - kept
        tl.store(marks + starts, d * BLOCK_B + i, mask=rows_ok & (kept > 0))
        tl.store(starts_at + i, starts)
        tl.store(weights + i, w)
        tl.debug_barrier()
        parent = tl.associative_scan(tl.load(marks + i), 0, _maximum) - d * BLOCK_B  # owner of slot i
        parent = tl.minimum(tl.maximum(parent, 0), budget - 1)  # (clamps only the padding slots)
        if CLOCKS:
            spent, last = _lap(spent, last, 4)
        child = i - tl.load(starts_at + parent, mask=rows_ok, other=0)
        w = tl.load(weights + parent, mask=rows_ok, other=float("-inf")) + \
            tl.load(lp + child, mask=rows_ok, other=float("-inf"))
        w = tl.where(rows_ok, w, float("-inf"))
        tl.debug_barrier()
        level = out + d * budget
        tl.store(w_out_ptr + level + i, w, mask=rows_ok)
        tl.store(parent_out_ptr + level + i, parent.to(tl.int64), mask=rows_ok)
        tl.store(token_out_ptr + level + i, tl.load(tok_row + d * k + child, mask=rows_ok, other=0), mask=rows_ok)
        if CLOCKS:
            spent, last = _lap(spent, last, 5)
    if CLOCKS:
        tl.store(clocks_ptr + row * CLOCK_STAGES + tl.arange(0, CLOCK_STAGES), spent)


@triton.jit
def _select_nodes_kernel(w_ptr, parent_ptr, token_ptr, budgets_ptr, tokens_out_ptr, parents_out_ptr, depths_out_ptr,
                         valid_out_ptr, logw_out_ptr, mask_out_ptr, flat_scratch_ptr, node_scratch_ptr, anc_scratch_ptr,
                         clocks_ptr, budget, DEPTH: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                         CLOCKS: tl.constexpr):
    """One row's tree from its kept lists (tree.py ``_select_nodes`` + ``_assemble``, exactly).

    w / parent / token: ``[DEPTH, budget]`` per row, flat index f = (depth - 1) * budget + place.
    1. The ``budget`` best over all depths: the budget-th best weight T (:func:`_kth_largest`, from
       the lower bound max over depths of the depth's worst kept weight: each depth keeps ``budget``),
       then everything above it and the first ties at it (lowest f), compacted in f order; then
       their (weight desc, f asc) order by one sort of ``budget`` int64 keys (float32 order bits
       above the reversed f). The first ``budgets[row]`` that exist are valid. 2. Node layout:
       valid nodes by depth (stable), invalid ones last, by a second sort. 3. Parents through a
       flat -> node map. 4. Each node's ancestor at every depth (anc), depth by depth; then in the
       mask (zeroed by the caller) mask[i, anc[i][k]] is set for k <= depth i (and mask[i, i] for every i).
    CLOCKS: SM cycles per stage to ``clocks_ptr`` [R, CLOCK_STAGES]: loads and lower bound,
    threshold, compaction, rank sort, layout and parents, ancestors, a barrier, mask ones."""
    row = tl.program_id(0).to(tl.int64)
    size = budget + 1  # N: root + nodes
    base = row * DEPTH * budget
    if CLOCKS:
        spent, last = tl.zeros([CLOCK_STAGES], tl.int64), _clock()
    # 1. best `budget` flat entries
    f = tl.arange(0, BLOCK_F)
    f_ok = f < DEPTH * budget
    wf = tl.load(w_ptr + base + f, mask=f_ok, other=float("-inf"))
    d = tl.arange(0, BLOCK_L)
    b = tl.arange(0, BLOCK_B)
    by_depth = tl.load(w_ptr + base + d[:, None] * budget + b[None, :],
                       mask=(d < DEPTH)[:, None] & (b < budget)[None, :], other=float("inf"))  # [BLOCK_L, BLOCK_B]
    lower = tl.max(tl.where(d < DEPTH, tl.min(by_depth, axis=1), float("-inf")), axis=0)
    if CLOCKS:
        spent, last = _lap(spent, last, 0)
    threshold = _kth_largest(wf, budget, lower)
    if CLOCKS:
        spent, last = _lap(spent, last, 1)
    tied = wf == threshold
    need = budget - tl.sum((wf > threshold).to(tl.int32), axis=0)  # ties to keep, lowest f first
    keep = (wf > threshold) | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))  # exactly `budget`
    flat_scratch = flat_scratch_ptr + row * BLOCK_F
    tl.store(flat_scratch + tl.cumsum(keep.to(tl.int32), axis=0) - 1, f, mask=keep)
    tl.debug_barrier()
    p = tl.arange(0, BLOCK_B)
    p_ok = p < budget
    kept_f = tl.load(flat_scratch + p, mask=p_ok, other=0)  # the kept flat indices, ascending
    if CLOCKS:
        spent, last = _lap(spent, last, 2)
    bits = tl.load(w_ptr + base + kept_f, mask=p_ok, other=float("-inf")).to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits).to(tl.int64)  # as tree._best_flat_by_key
    keys = tl.where(p_ok, (order << 32) + (BLOCK_F - kept_f).to(tl.int64), -9223372036854775807)
    keys = tl.sort(keys, 0, descending=True)  # [BLOCK_B]
    flats = BLOCK_F - (keys - ((keys >> 32) << 32)).to(tl.int32)  # flat index by rank
    tl.debug_barrier()  # every read of the compacted list is done
    tl.store(flat_scratch + p, flats, mask=p_ok)
    tl.debug_barrier()
    if CLOCKS:
        spent, last = _lap(spent, last, 3)
    # 2. layout: (valid ? depth : DEPTH + 1, rank) ascending
    p = tl.arange(0, BLOCK_B)
    p_ok = p < budget
    flat_p = tl.load(flat_scratch + p, mask=p_ok, other=0)
    w_p = tl.load(w_ptr + base + flat_p, mask=p_ok, other=float("-inf"))
    valid_p = p_ok & (p < tl.load(budgets_ptr + row)) & (w_p > float("-inf"))
    depth_p = flat_p // budget + 1
    layout = tl.sort(tl.where(valid_p, depth_p, tl.where(p_ok, DEPTH + 1, DEPTH + 2)) * BLOCK_B + p, 0)
    q = p  # node q + 1 of the layout
    rank_q = layout % BLOCK_B
    valid_q = (layout // BLOCK_B) <= DEPTH
    depth_q = tl.where(valid_q, layout // BLOCK_B, 0)
    flat_q = tl.load(flat_scratch + rank_q, mask=p_ok, other=0)
    # 3. parents
    node_scratch = node_scratch_ptr + row * BLOCK_F  # flat -> node
    tl.store(node_scratch + flat_q, q + 1, mask=valid_q)
    tl.debug_barrier()
    place = tl.load(parent_ptr + base + flat_q, mask=valid_q, other=0).to(tl.int32)
    parent_q = tl.load(node_scratch + (depth_q - 2) * budget + place, mask=valid_q & (depth_q > 1), other=0)
    out = row * size
    tl.store(tokens_out_ptr + out + 1 + q, tl.load(token_ptr + base + flat_q, mask=valid_q, other=0), mask=p_ok)
    tl.store(parents_out_ptr + out + 1 + q, parent_q.to(tl.int64), mask=p_ok)
    tl.store(depths_out_ptr + out + 1 + q, depth_q.to(tl.int64), mask=p_ok)
    tl.store(valid_out_ptr + out + 1 + q, valid_q.to(tl.int8), mask=p_ok)
    tl.store(logw_out_ptr + out + 1 + q, tl.where(valid_q, tl.load(w_ptr + base + flat_q, mask=valid_q, other=0.0),
                                                 float("-inf")), mask=p_ok)
    tl.store(tokens_out_ptr + out, -1)
    tl.store(parents_out_ptr + out, -1)
    tl.store(depths_out_ptr + out, 0)
    tl.store(valid_out_ptr + out, 1)
    tl.store(logw_out_ptr + out, 0.0)
    if CLOCKS:
        spent, last = _lap(spent, last, 4)
    # 4. ancestors at every depth: anc[n][k], root row all 0
    anc = anc_scratch_ptr + row * BLOCK_N * BLOCK_L
    k = tl.arange(0, BLOCK_L)
    tl.store(anc + k, tl.zeros_like(k))
    tl.debug_barrier()
    for level in range(1, DEPTH + 1):
        at_d = valid_q & (depth_q == level)
        upper = tl.load(anc + parent_q[:, None] * BLOCK_L + k[None, :], mask=at_d[:, None], other=0)
        mine = tl.where(k[None, :] < level, upper, tl.where(k[None, :] == level, q[:, None] + 1, 0))
        tl.store(anc + (q[:, None] + 1) * BLOCK_L + k[None, :], mine, mask=at_d[:, None])
        tl.debug_barrier()
    if CLOCKS:
        spent, last = _lap(spent, last, 5)
    mask_row = mask_out_ptr + row * size * size  # (zeroed by the caller)
    tl.debug_barrier()  # the node outputs are written before they are read back below
    if CLOCKS:
        spent, last = _lap(spent, last, 6)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < size
    depth_n = tl.load(depths_out_ptr + out + n, mask=n_ok, other=0).to(tl.int32)
    valid_n = tl.load(valid_out_ptr + out + n, mask=n_ok, other=0) != 0
    on_path = (valid_n & n_ok)[:, None] & (k[None, :] <= depth_n[:, None])  # [BLOCK_N, BLOCK_L]
    seen = tl.load(anc + n[:, None] * BLOCK_L + k[None, :], mask=on_path, other=0)  # ancestors, self included
    tl.store(mask_row + n[:, None] * size + seen, tl.full(on_path.shape, 1, tl.int8), mask=on_path)
    tl.store(mask_row + n * size + n, tl.full(n.shape, 1, tl.int8), mask=n_ok)  # invalid nodes: themselves
    if CLOCKS:
        spent, last = _lap(spent, last, 7)
        tl.store(clocks_ptr + row * CLOCK_STAGES + tl.arange(0, CLOCK_STAGES), spent)


@triton.jit
def _accept_walk_kernel(tokens_ptr, parents_ptr, valid_ptr, choice_ptr, path_ptr, committed_ptr, lengths_ptr,
                        bonus_ptr, size, STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row's accept walk (speculative/verify.py ``accept_walk``, exactly): from the root, move to the
    lowest-index valid child whose token is the target's choice at the current node, at most
    STEPS times; write the path, its tokens, its length and the next bonus token."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < size
    tree = row * size
    tokens = tl.load(tokens_ptr + tree + n, mask=n_ok, other=0)
    parents = tl.load(parents_ptr + tree + n, mask=n_ok, other=-1)
    walkable = n_ok & (tl.load(valid_ptr + tree + n, mask=n_ok, other=0) != 0) & (n != 0)
    out = row * (STEPS + 1)
    tl.store(path_ptr + out, 0)
    tl.store(committed_ptr + out, tl.load(tokens_ptr + tree))
    current = tl.zeros([], tl.int64)
    length = tl.full([], 1, tl.int64)
    for step in range(1, STEPS + 1):
        wanted = tl.load(choice_ptr + tree + current)
        match = walkable & (parents == current) & (tokens == wanted)
        child = tl.min(tl.where(match, n, BLOCK_N), axis=0).to(tl.int64)
        found = (child < BLOCK_N) & (length == step)  # the walk is still going
        tl.store(path_ptr + out + step, tl.where(found, child, -1))
        token = tl.load(tokens_ptr + tree + child, mask=found, other=0)
        tl.store(committed_ptr + out + step, tl.where(found, token, -1))
        current = tl.where(found, child, current)
        length = tl.where(found, length + 1, length)
    tl.store(lengths_ptr + row, length)
    tl.store(bonus_ptr + row, tl.load(choice_ptr + tree + current))


@triton.jit
def _commit_kernel(storage_ptr, table_ptr, slots_ptr, starts_ptr, keep_ptr, counts_ptr, lengths_ptr, n_keep,
                   table_stride, page_stride, plane_stride, page_size, heads, head_dim, BLOCK_P: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, layer x k/v plane): moves the row's scratch entries ``keep[row, j]`` (j < n_keep)
    to ``starts[row] + j`` for every kv head (kv.cache.KVCache.commit, exactly), each position
    found through the slot's block table. Every entry is read before any is written: a kept entry
    may land where another one is read. Plane 0 also sets the slot's committed length,
    ``lengths[slots[row]] = starts[row] + counts[row]``."""
    row = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    j_ok = j < n_keep
    start = tl.load(starts_ptr + row)
    slot = tl.load(slots_ptr + row)
    if plane == 0:
        tl.store(lengths_ptr + slot, start + tl.load(counts_ptr + row))
    table = table_ptr + slot * table_stride
    src = start + tl.maximum(tl.load(keep_ptr + row * n_keep + j, mask=j_ok, other=0), 0)  # [BLOCK_P] positions
    dst = start + j
    src_at = tl.load(table + src // page_size, mask=j_ok, other=0) * page_stride + (src % page_size) * head_dim
    dst_at = tl.load(table + dst // page_size, mask=j_ok, other=0) * page_stride + (dst % page_size) * head_dim
    base = storage_ptr + plane * plane_stride
    inner = h[None, :, None] * page_size * head_dim + d[None, None, :]  # [1, BLOCK_H, BLOCK_D]
    ok = j_ok[:, None, None] & (h < heads)[None, :, None] & (d < head_dim)[None, None, :]
    moved = tl.load(base + src_at[:, None, None] + inner, mask=ok)
    tl.debug_barrier()  # all reads first
    tl.store(base + dst_at[:, None, None] + inner, moved, mask=ok)
