"""Triton kernels of the fused mixture-of-experts MLP (behind :mod:`flashtree.kernels.gpu.moe`).

A *pair* is one (token, rank) choice: pair ``p = t * TOP_K + j`` is token t's j-th expert. A *slot*
is a row of the expert-sorted, per-expert padded order the grouped products walk: every block of
BLOCK_M slots belongs to one expert, and ``block_rows`` of its rows hold real pairs.
"""

import triton
import triton.language as tl


@triton.jit
def _router_partials_kernel(x_ptr, gate_ptr, part_ptr, T, E, H, stride_x, stride_gate, E_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One BLOCK_K-wide slice of K (chunk ``program_id(2)``) of the router logits of BLOCK_M tokens for BLOCK_E
    experts, float32 from zero, stored to ``part [chunks, T, E_PAD]``; :func:`_select_experts_kernel` adds
    the chunks in order. Spread over tokens x experts x chunks, a lone token's router read is many short
    reads in parallel, not a few long ones in sequence."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    x = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + k[None, :],
                mask=(tokens[:, None] < T) & (k[None, :] < H), other=0.0)  # [BM, BK]
    g = tl.load(gate_ptr + experts[:, None] * stride_gate + k[None, :],
                mask=(experts[:, None] < E) & (k[None, :] < H), other=0.0)  # [BE, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    if IEEE:
        acc = tl.dot(x, tl.trans(g), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(g), acc)
    part = part_ptr + tl.program_id(2).to(tl.int64) * T * E_PAD
    tl.store(part + tokens[:, None].to(tl.int64) * E_PAD + experts[None, :], acc,
             mask=(tokens[:, None] < T) & (experts[None, :] < E))


@triton.jit
def _select_experts_kernel(part_ptr, x_ptr, weights_ptr, ids_ptr, counts_ptr, sorted_pairs_ptr, block_experts_ptr,
                           block_rows_ptr, T, E, CHUNKS, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                           NORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                           PLAN_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """BLOCK_M tokens' router logits (the chunk partials ``part [CHUNKS, T, E_PAD]`` added in chunk order
    from zero, rounded to x's dtype as a linear layer returns them), their float32 softmax, the TOP_K
    most probable experts (the lower id on a tie), renormalized to sum 1 when NORMALIZE; writes
    weights (float32) and ids ``[T, TOP_K]``, by rank, and how many of these tokens' pairs each expert
    got (``counts [programs, E_PAD]``, this program's row). PAIR_BLOCKS (one token: its experts are
    distinct) also writes the plan of one block of PLAN_M slots per pair, in rank order."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    experts = tl.arange(0, E_PAD)  # [EP]
    valid = (tokens[:, None] < T) & (experts[None, :] < E)  # [BM, EP]
    offsets = tokens[:, None].to(tl.int64) * E_PAD + experts[None, :]  # [BM, EP]
    logits = tl.zeros((BLOCK_M, E_PAD), dtype=tl.float32)
    for chunk in range(CHUNKS):
        logits += tl.load(part_ptr + chunk * T * E_PAD + offsets, mask=valid, other=0.0)
    logits = tl.where(valid, logits.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))  # [BM, EP]
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    probs = tl.where(experts[None, :] < E, probs, -1.0)  # (rows past T are all -inf: NaN, never stored)
    ranks = tl.arange(0, TOP_K_PAD)  # [KP]
    chosen = tl.zeros((BLOCK_M, TOP_K_PAD), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_M, TOP_K_PAD), dtype=tl.int32)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)  # [BM]
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), axis=1)  # [BM]
        picked = (experts[None, :] == best_id[:, None]) & (tokens[:, None] < T)  # [BM, EP]
        counts += tl.sum(picked.to(tl.int32), axis=0)
        chosen = tl.where(ranks[None, :] == j, best[:, None], chosen)
        chosen_ids = tl.where(ranks[None, :] == j, best_id[:, None], chosen_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)  # (probabilities are >= 0)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    out = tokens[:, None] * TOP_K + ranks[None, :]
    keep = (tokens[:, None] < T) & (ranks[None, :] < TOP_K)
    tl.store(weights_ptr + out, chosen, mask=keep)
    tl.store(ids_ptr + out, chosen_ids, mask=keep)
    tl.store(counts_ptr + tl.program_id(0) * E_PAD + experts, counts)
    if PAIR_BLOCKS:  # pair p (= its rank, of token 0) in block p, alone
        tl.store(sorted_pairs_ptr + out * PLAN_M, out, mask=keep)
        tl.store(block_experts_ptr + out, chosen_ids, mask=keep)
        tl.store(block_rows_ptr + out, 1 + 0 * out, mask=keep)


@triton.jit
def _sort_by_expert_kernel(ids_ptr, counts_ptr, sorted_pairs_ptr, block_experts_ptr, block_rows_ptr, P, GROUPS,
                           NUM_BLOCKS, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, GROUP_TILE: tl.constexpr,
                           CHUNK: tl.constexpr):
    """One program per expert e: the experts' pair counts (summed over the routing programs' rows of
    ``counts [GROUPS, E_PAD]``) padded up to multiples of BLOCK_M give e's first slot (experts in id
    order); e's pairs go to its slots in pair order, and its blocks get their expert and real rows.
    Expert 0 also marks the blocks past the last expert's (-1, 0 rows)."""
    expert = tl.program_id(0)
    experts = tl.arange(0, E_PAD)  # [EP]
    groups = tl.arange(0, GROUP_TILE)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for g0 in range(0, GROUPS, GROUP_TILE):
        rows = g0 + groups
        counts += tl.sum(tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=rows[:, None] < GROUPS,
                                 other=0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [EP]
    starts = tl.cumsum(padded, axis=0) - padded
    start = tl.sum(tl.where(experts == expert, starts, 0), axis=0)  # this expert's first slot
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    lanes = tl.arange(0, CHUNK)
    placed = 0  # this expert's pairs placed so far
    for p0 in range(0, P, CHUNK):
        pairs = p0 + lanes
        mine = (tl.load(ids_ptr + pairs, mask=pairs < P, other=-1) == expert).to(tl.int32)  # [CHUNK]
        slot = start + placed + tl.cumsum(mine, axis=0) - mine
        tl.store(sorted_pairs_ptr + slot, pairs, mask=mine != 0)
        placed += tl.sum(mine, axis=0)
    first_block = start // BLOCK_M
    for b0 in range(0, count, BLOCK_M * CHUNK):  # its blocks (none without pairs)
        block = b0 // BLOCK_M + lanes
        rows = tl.minimum(count - block * BLOCK_M, BLOCK_M)
        tl.store(block_experts_ptr + first_block + block, expert + 0 * block, mask=rows > 0)
        tl.store(block_rows_ptr + first_block + block, rows, mask=rows > 0)
    if expert == 0:
        used = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(used, NUM_BLOCKS, CHUNK):
            block = b0 + lanes
            tl.store(block_experts_ptr + block, -1 + 0 * block, mask=block < NUM_BLOCKS)
            tl.store(block_rows_ptr + block, 0 * block, mask=block < NUM_BLOCKS)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_pairs_ptr, block_experts_ptr, block_rows_ptr,
                    N, K, stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    """act[slot, n] = silu(gate) * up for the block's BLOCK_M slots and BLOCK_N of the N = I columns,
    gate and up the products of the slot's token row of x with its expert's rows n and N + n of
    w ``[E, 2N, K]``; K in BLOCK_K steps from 0 up, float32 accumulation."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    real = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + block)  # [BM]
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(sorted_pairs_ptr + slots, mask=real, other=0) // TOP_K  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    depth = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=real[:, None] & (k[None, :] < K), other=0.0)  # [BM, BK]
        w_mask = (cols[:, None] < N) & (k[None, :] < K)
        w_gate = tl.load(w_expert + cols[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)  # [BN, BK]
        w_up = tl.load(w_expert + (cols[:, None] + N) * stride_wn + k[None, :], mask=w_mask, other=0.0)
        if IEEE:  # float32 inputs: full-precision products, not TF32
            gate = tl.dot(x, tl.trans(w_gate), gate, input_precision="ieee")
            up = tl.dot(x, tl.trans(w_up), up, input_precision="ieee")
        else:
            gate = tl.dot(x, tl.trans(w_gate), gate)
            up = tl.dot(x, tl.trans(w_up), up)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=real[:, None] & (cols[None, :] < N))


@triton.jit
def _down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, block_rows_ptr,
                 N, K, stride_act, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[pair, n] = (act[slot] . w[expert, n]) * weights[pair] in float32 for the block's real slots
    and BLOCK_N of the N = H columns (w ``[E, N, K]``, K = I); K in BLOCK_K steps from 0 up."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    real = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + block)  # [BM]
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + slots, mask=real, other=0)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    depth = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + depth
        a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_act + k[None, :],
                    mask=real[:, None] & (k[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_expert + cols[:, None] * stride_wn + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)  # [BN, BK]
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    acc *= tl.load(weights_ptr + pairs, mask=real, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], acc,
             mask=real[:, None] & (cols[None, :] < N))


@triton.jit
def _sum_pairs_kernel(pair_out_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = pair_out[t * TOP_K] + ... + pair_out[t * TOP_K + TOP_K - 1], in that order, in float32,
    rounded once to out's dtype."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_out_ptr + (token * TOP_K + j) * H + cols, mask=cols < H, other=0.0)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)
