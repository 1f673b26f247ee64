"""Triton kernels of the fused mixture-of-experts MLP (behind :mod:`flashtree.kernels.gpu.moe`).

A *pair* is one (token, rank) choice: pair ``p = t * TOP_K + j`` is token t's j-th expert. A *slot*
is a row of the expert-sorted, per-expert padded order the grouped products walk: every block of
BLOCK_M slots belongs to one expert, and ``block_rows`` of its rows hold real pairs.
"""

import triton
import triton.language as tl


@triton.jit
def _route_kernel(x_ptr, gate_ptr, weights_ptr, ids_ptr, T, E, H, stride_x, stride_gate,
                  TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Router logits of BLOCK_M tokens (rounded to x's dtype, as a linear layer returns them), a
    float32 softmax over the experts, the TOP_K most probable (the lower id on a tie), renormalized
    to sum 1 when NORMALIZE; writes weights (float32) and ids ``[T, TOP_K]``, by rank."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    experts = tl.arange(0, E_PAD)  # [EP]
    depth = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, E_PAD), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=(tokens[:, None] < T) & (k[None, :] < H), other=0.0)  # [BM, BK]
        g = tl.load(gate_ptr + experts[:, None] * stride_gate + k[None, :],
                    mask=(experts[:, None] < E) & (k[None, :] < H), other=0.0)  # [EP, BK]
        if IEEE:
            acc = tl.dot(x, tl.trans(g), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(g), acc)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(experts[None, :] < E, logits, float("-inf"))  # [BM, EP]
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    ranks = tl.arange(0, TOP_K_PAD)  # [KP]
    chosen = tl.zeros((BLOCK_M, TOP_K_PAD), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_M, TOP_K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)  # [BM]
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), axis=1)  # [BM]
        chosen = tl.where(ranks[None, :] == j, best[:, None], chosen)
        chosen_ids = tl.where(ranks[None, :] == j, best_id[:, None], chosen_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)  # (probabilities are >= 0)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    out = tokens[:, None] * TOP_K + ranks[None, :]
    keep = (tokens[:, None] < T) & (ranks[None, :] < TOP_K)
    tl.store(weights_ptr + out, chosen, mask=keep)
    tl.store(ids_ptr + out, chosen_ids, mask=keep)


@triton.jit
def _sort_by_expert_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, block_rows_ptr, P, E, NUM_BLOCKS,
                           BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, TILE: tl.constexpr):
    """One program: counts pairs per expert, pads each count up to a multiple of BLOCK_M, and writes
    each pair's index at its slot (experts in id order, an expert's pairs in pair order); then, per
    block of BLOCK_M slots, its expert and real rows (-1 and 0 past the last expert's blocks)."""
    experts = tl.arange(0, E_PAD)  # [EP]
    lanes = tl.arange(0, TILE)  # [TILE]
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, P, TILE):
        ids = tl.load(ids_ptr + p0 + lanes, mask=p0 + lanes < P, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [EP]
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    seen = tl.zeros((E_PAD,), dtype=tl.int32)  # pairs of each expert placed so far
    for p0 in range(0, P, TILE):
        pairs = p0 + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=-1)
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [TILE, EP]
        before = tl.cumsum(hot, axis=0) - hot + seen[None, :]  # the expert's pairs ahead of this one
        slot = tl.sum(hot * (starts[None, :] + before), axis=1)  # [TILE]
        tl.store(sorted_pairs_ptr + slot, pairs, mask=pairs < P)
        seen += tl.sum(hot, axis=0)
    for b0 in range(0, NUM_BLOCKS, TILE):
        blocks = b0 + lanes
        first = blocks * BLOCK_M  # [TILE] the block's first slot
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # experts whose slots end before it
        is_owner = experts[None, :] == owner[:, None]  # [TILE, EP]
        owner_start = tl.sum(tl.where(is_owner, starts[None, :], 0), axis=1)
        owner_count = tl.sum(tl.where(is_owner, counts[None, :], 0), axis=1)
        rows = tl.minimum(owner_count - (first - owner_start), BLOCK_M)
        used = first < total
        tl.store(block_experts_ptr + blocks, tl.where(used, owner, -1), mask=blocks < NUM_BLOCKS)
        tl.store(block_rows_ptr + blocks, tl.where(used, rows, 0), mask=blocks < NUM_BLOCKS)


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
