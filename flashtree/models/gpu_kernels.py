"""Fused Triton kernels for the decoder's small per-layer ops on CUDA.

A decode step at batch 1 is a few large matmuls and, between them, dozens of tiny element-wise
kernels per layer (norms, rotary, residual adds, KV-cache writes); on an H200 those tiny kernels
cost about a third of the step (benchmarks/README.md). Three kernels replace them:

- :func:`add_rms_norm`: residual add + RMSNorm in one pass (returns both the sum and its norm);
- :func:`qkv_norm_rope_write`: from the fused qkv projection, per head: optional q/k RMSNorm,
  rotary at the token's position, and the K/V written straight into the KV cache; returns q in
  the ``[B, H, N, D]`` layout attention wants;
- :func:`silu_mul`: ``silu(gate) * up`` from the fused gate-up projection;
- :func:`tree_attention`: attention of each row's new tokens over its committed context and the
  new tokens its ``new_mask`` allows (a chain, a tree, a block), read straight from the KV cache
  by slot and length. Lengths are device tensors, so one CUDA graph serves every context length
  and slot layout (the SDPA path needs the longest context and a slot range in the graph key).
  Long contexts at small batch are split across programs and merged (flash-decoding);
- :func:`expand_levels`: DDTree's per-depth kept lists (``spec/tree.py``) for all depths in one
  kernel per row, instead of a dozen small kernels per depth;
- :func:`select_nodes`: the tree itself from those lists (best nodes over all depths, layout,
  parents, ancestor mask) in one kernel per row, instead of about fifty small kernels;
- :func:`accept_walk`: the accept walk (``spec/verify.py``) in one kernel per row.

Arithmetic is float32 inside each kernel with one rounding to the storage dtype at the end (the
unfused path rounds after every op), except that a q/k norm's result is rounded to the storage
dtype before rotary, as the reference models do. Every kernel treats tokens independently, so a
token's result does not depend on how many others share the batch.

Triton is optional: :func:`available` is False without it (the CPU wheel of torch does not bring
it) and the models keep their plain torch ops. ``TRITON_INTERPRET=1`` runs these kernels on CPU
tensors (tests use it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from flashtree.models.feature_sink import SinkSegment


def available() -> bool:
    """Triton is installed (kernels can run on CUDA tensors, or anywhere when interpreting)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable_on(tensor: torch.Tensor) -> bool:
    """These kernels can run on ``tensor``'s device."""
    return available() and (tensor.is_cuda or interpreting())


@functools.cache
def _kernels():
    from flashtree.models import triton_kernels

    return triton_kernels


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


ADD_RMS_NORM_COPIES = True  # add_rms_norm takes ``copy_to`` (the unfused path writes the copy itself)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 copy_to: SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual ``[..., width]`` -> (rms_norm(x + residual) * weight, x + residual); with
    ``copy_to`` (models/feature_sink.py) the sum of token t also goes to row ``copy_to.rows[t]``
    of ``copy_to.columns``, in the same kernel."""
    width = x.shape[-1]
    x, residual = x.contiguous(), residual.contiguous()
    total = torch.empty_like(x)
    normed = torch.empty_like(x)
    if copy_to is not None:
        columns, rows = copy_to.columns, copy_to.rows
        assert columns.stride(1) == 1 and rows.numel() == x.numel() // width, "copy_to: one row per token"
    else:
        columns, rows = x, x  # not read (COPY is off)
    _kernels()._add_rms_norm_kernel[(x.numel() // width,)](x, residual, weight, total, normed, width, eps,
                                                           columns, rows, columns.stride(0),
                                                           BLOCK=_next_power_of_2(width), COPY=copy_to is not None)
    return normed, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[..., 2 * width]`` (gate first) -> ``silu(gate) * up`` ``[..., width]``."""
    width = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    block = 1024
    _kernels()._silu_mul_kernel[(gate_up.numel() // (2 * width), -(-width // block))](gate_up, out, width, BLOCK=block)
    return out


def qkv_write_operands(qkv: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       write_index: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Checked, contiguous operands of a qkv_norm_rope_write (either backend): qkv, the empty q
    ``[B, H, N, D]`` output, and the write slots and entries ``[B, N]``."""
    b, n, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    if head_dim % 2 or head_dim * (heads + 2 * kv_heads) != width:
        raise ValueError(f"qkv of width {width} does not hold {heads} + 2 x {kv_heads} heads of an even size")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must be views with the same strides and a contiguous last dim")
    slots, entries = (t.contiguous() for t in write_index)
    return qkv.contiguous(), qkv.new_empty(b, heads, n, head_dim), slots, entries


def qkv_norm_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None, eps: float,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate q and k, write k and v into the cache; returns q ``[B, H, N, D]``.

    qkv: ``[B, N, (H + 2 KVH) * D]`` (q heads, then k heads, then v heads); qk_norm: ``[2, D]``, the
    q-norm then the k-norm weight, or None (no q/k norm); cos_table/sin_table: ``[P, D]`` (halves
    repeated, as :class:`~flashtree.models.rope.RotaryTable` stores them); positions: ``[B, N]`` rotary positions;
    k_cache/v_cache: one layer's ``[slots, KVH, capacity, D]`` views; write_index: (slot, entry)
    ``[B, N]`` each, where each token's K/V go.
    """
    qkv, q, slots, entries = qkv_write_operands(qkv, heads, kv_heads, k_cache, v_cache, write_index)
    b, n, _ = qkv.shape
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1):
        raise ValueError(f"qkv_norm_rope_write needs a power-of-two head_dim, got {head_dim}")
    _kernels()._qkv_norm_rope_write_kernel[(b * n, heads + kv_heads)](
        qkv, qkv if qk_norm is None else qk_norm.contiguous(), cos_table, sin_table,
        positions.contiguous(), slots, entries, q, k_cache, v_cache,
        n, heads, kv_heads, eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HALF=head_dim // 2, QK_NORM=qk_norm is not None)
    return q


def handles_attention(new_tokens: int) -> bool:
    """:func:`tree_attention` serves forwards of any width."""
    return True


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _key_splits(programs: int, capacity: int, device: torch.device) -> int:
    """Key splits per (row, kv head, query tile): enough programs for about two waves on the
    device, at most one split per 256 cache entries, a power of two up to 16."""
    want = max(1, min(2 * _multiprocessors(device) // max(programs, 1), capacity // 256, 16))
    return 1 << (want.bit_length() - 1)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   lengths: torch.Tensor, new_mask: torch.Tensor, window: int | None = None,
                   splits: int | None = None) -> torch.Tensor:
    """Attention of N new tokens per row over the KV cache; returns ``[B, H, N, D]``.

    q: ``[B, H, N, D]``; k_cache/v_cache: one layer's ``[slots, KVH, capacity, D]`` views holding,
    for row b at slot ``slots[b]``, the committed entries ``0 .. lengths[b]-1`` followed by the N
    new tokens' entries. Query i of row b sees every committed entry (only the last ``window``
    ones with a sliding window) and new token t where ``new_mask[b, i, t]``. ``splits`` overrides
    the number of key splits (tests).
    """
    b, heads, n, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if head_dim < 16 or head_dim & (head_dim - 1) or heads % kv_heads:
        raise ValueError(f"tree_attention needs a power-of-two head_dim >= 16 and heads divisible by kv heads, "
                         f"got head_dim={head_dim}, heads={heads}, kv_heads={kv_heads}")
    group = heads // kv_heads
    block_m = min(64, max(16, _next_power_of_2(n * group)))
    m_tiles = -(-n * group // block_m)
    splits = splits or _key_splits(b * kv_heads * m_tiles, k_cache.shape[2], q.device)
    q = q.contiguous()
    out = torch.empty_like(q)
    part = out if splits == 1 else torch.empty(b, heads, n, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = out if splits == 1 else torch.empty(b, heads, n, splits, dtype=torch.float32, device=q.device)
    _kernels()._tree_attention_kernel[(b * kv_heads, m_tiles, splits)](
        q, k_cache, v_cache, slots.contiguous(), lengths.contiguous(), new_mask.contiguous().view(torch.uint8),
        part, lse, n, heads, kv_heads, window or 0, head_dim ** -0.5 * 1.4426950408889634,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64, SPLITS=splits,
        IEEE=q.dtype == torch.float32, INTERPRET=interpreting())
    if splits > 1:
        _kernels()._combine_splits_kernel[(b * heads * n,)](part, lse, out, SPLITS=splits, HEAD_DIM=head_dim)
    return out


# warps per program of the tree kernels (one program per row; H200 timings by warps:
# benchmarks/gpu_tree_kernel_warps.py)
TREE_WARPS = 4
# the kept-list kernel's, by threshold search: its sorts run faster on 8 warps (budget 256, narrow:
# 0.081 against 0.097 ms; budget 64, sort: 0.049 against 0.053 ms), its bisection does not (0.113
# against 0.112 ms at 256); benchmarks/results/session9/call3/t/warps.json, session8/call3
EXPAND_WARPS = {"sort": 8, "bisect": 4, "narrow": 8}
# prefilter lists (padded to a power of two) up to this length find each depth's threshold by a
# sort, longer ones by a search (_kth_largest). H200, batch 1, build + walk: sorting was faster at
# budgets 16 and 64 (0.16 / 0.21 ms against 0.21 / 0.25 ms), bisection at 256 and 1024 (0.45 /
# 0.88 ms against 0.54 / 2.70 ms); benchmarks/results/session6/tree_build_speed_h200_session6{,_v3}.json
# (a radix select by 8-bit histograms was slower still: 0.215 against 0.145 ms for the kept lists
# at budget 256; benchmarks/results/session7/gpu_next_checks_output.txt; and a search counting 16
# keys per step, 10 steps instead of 32, doubled build + walk at budget 256: 0.71 against 0.35 ms,
# benchmarks/results/session8/call1/tree_build_speed_ways16.json)
SORT_LIST_MAX = 512
# longer lists narrow the bisection and then sort what is left ("narrow") when the sort is at most
# this long (twice the padded budget: budgets 65-256), else they bisect to the end ("bisect")
NARROW_MAX = 512
THRESHOLD_SEARCHES = ("sort", "bisect", "narrow")


def threshold_search(pairs: int, max_budget: int) -> str:
    """The kept-list kernel's default threshold search for a prefilter list of ``pairs`` entries."""
    if _next_power_of_2(pairs) <= SORT_LIST_MAX:
        return "sort"
    return "narrow" if 2 * _next_power_of_2(max_budget) <= NARROW_MAX else "bisect"


def expand_levels(top_logp: torch.Tensor, top_tokens: torch.Tensor, max_budget: int, pair_row: torch.Tensor,
                  pair_rank: torch.Tensor, num_warps: int | None = None, search: str | None = None,
                  stage_clocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``spec/tree.py _expand_levels`` for float32 log-probs, exactly: per depth the ``max_budget``
    best prefixes, ties to the lower (parent place, rank). top_logp / top_tokens: ``[R, L, K]``
    (K best per depth, descending); pair_row / pair_rank: ``[M]`` the prefilter pairs of
    ``tree._prefilter_pairs``. Returns weights, parent places and tokens, ``[R, L, B]`` each.
    ``num_warps``: per program (default :data:`EXPAND_WARPS` of the search; benchmarks compare others).
    ``search``: how each depth's threshold is found, one of :data:`THRESHOLD_SEARCHES` (default
    :func:`threshold_search`; ``triton_kernels._expand_levels_kernel`` describes them); all give
    the same lists.
    ``stage_clocks``: an int64 ``[R, 8]`` tensor that receives SM cycles per stage of the kernel
    (CUDA only; ``triton_kernels._expand_levels_kernel`` names the stages)."""
    if top_logp.dtype != torch.float32:
        raise ValueError(f"expand_levels needs float32 log-probs, got {top_logp.dtype}")
    search = threshold_search(pair_row.numel(), max_budget) if search is None else search
    if search not in THRESHOLD_SEARCHES:
        raise ValueError(f"search must be one of {THRESHOLD_SEARCHES}, got {search!r}")
    rows, depth, k = top_logp.shape
    block = _next_power_of_2(max_budget)
    block_m = _next_power_of_2(pair_row.numel())
    narrow = 2 * block if search == "narrow" else 0
    weights = top_logp.new_empty(rows, depth, max_budget)
    parents = torch.empty(rows, depth, max_budget, dtype=torch.long, device=top_logp.device)
    tokens = torch.empty_like(parents)
    index_scratch = torch.empty(rows, 2, block, dtype=torch.int32, device=top_logp.device)  # slot marks, row starts
    weight_scratch = top_logp.new_empty(rows, 2 * block + narrow)  # kept weights, the same sorted, gathered list
    _kernels()._expand_levels_kernel[(rows,)](
        top_logp.contiguous(), top_tokens.contiguous(), pair_row.to(torch.int32), pair_rank.to(torch.int32),
        weights, parents, tokens, index_scratch, weight_scratch, _clocks_or_dummy(stage_clocks, tokens), k,
        max_budget, pair_row.numel(), DEPTH=depth, BLOCK_B=block, BLOCK_M=block_m, LOG_K=k.bit_length(),
        SEARCH=THRESHOLD_SEARCHES.index(search), NARROW=narrow, CLOCKS=stage_clocks is not None,
        num_warps=num_warps or EXPAND_WARPS[search])
    return weights, parents, tokens


def _clocks_or_dummy(stage_clocks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The stage-clock output, or any int64 tensor for the unused pointer when clocks are off."""
    if stage_clocks is None:
        return like
    if stage_clocks.dtype != torch.int64 or stage_clocks.shape != (like.shape[0], 8):
        raise ValueError(f"stage_clocks must be int64 [{like.shape[0]}, 8], got {stage_clocks.dtype} "
                         f"{tuple(stage_clocks.shape)}")
    return stage_clocks


def select_nodes(weights: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, budgets: torch.Tensor,
                 max_budget: int, num_warps: int | None = None,
                 stage_clocks: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``spec/tree.py _select_nodes`` and ``_assemble`` in one kernel per row, exactly: from the
    kept lists (weights / parent places / tokens ``[R, L, B]``, as :func:`expand_levels` returns
    them) and budgets ``[R]``, the tree's tokens, parents, depths, valid ``[R, B+1]``, ancestor mask
    ``[R, B+1, B+1]`` and log weights ``[R, B+1]`` (DraftTree's field order). ``stage_clocks``: as
    in :func:`expand_levels`."""
    rows, depth, budget = weights.shape
    size = budget + 1
    block_f = _next_power_of_2(depth * budget)
    block_n = _next_power_of_2(size)
    block_l = _next_power_of_2(depth + 1)
    device = weights.device
    long = dict(dtype=torch.long, device=device)
    out_tokens, out_parents, out_depths = (torch.empty(rows, size, **long) for _ in range(3))
    valid = torch.empty(rows, size, dtype=torch.uint8, device=device)
    log_weights = weights.new_empty(rows, size)
    mask = torch.zeros(rows, size, size, dtype=torch.uint8, device=device)  # (a memset: faster than in the kernel)
    flat_scratch, node_scratch = (torch.empty(rows, block_f, dtype=torch.int32, device=device) for _ in range(2))
    anc_scratch = torch.empty(rows, block_n, block_l, dtype=torch.int32, device=device)
    _kernels()._select_nodes_kernel[(rows,)](
        weights.contiguous(), parents.contiguous(), tokens.contiguous(), budgets.contiguous(), out_tokens, out_parents,
        out_depths, valid, log_weights, mask, flat_scratch, node_scratch, anc_scratch,
        _clocks_or_dummy(stage_clocks, out_tokens), budget, DEPTH=depth, BLOCK_F=block_f,
        BLOCK_B=_next_power_of_2(budget), BLOCK_N=block_n, BLOCK_L=block_l,
        CLOCKS=stage_clocks is not None, num_warps=num_warps or TREE_WARPS)
    return out_tokens, out_parents, out_depths, valid.view(torch.bool), mask.view(torch.bool), log_weights


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, choice: torch.Tensor,
                max_depth: int) -> tuple[torch.Tensor, ...]:
    """``spec/verify.py accept_walk`` in one kernel per row: tree tokens / parents / valid and the
    target's choices ``[R, N]`` -> path and committed tokens ``[R, max_depth + 1]``, accept
    lengths and next bonus tokens ``[R]``."""
    rows, size = tokens.shape
    path = torch.empty(rows, max_depth + 1, dtype=torch.long, device=tokens.device)
    committed = torch.empty_like(path)
    lengths = torch.empty(rows, dtype=torch.long, device=tokens.device)
    bonus = torch.empty_like(lengths)
    _kernels()._accept_walk_kernel[(rows,)](
        tokens.contiguous(), parents.contiguous(), valid.contiguous().view(torch.uint8), choice.long().contiguous(),
        path, committed, lengths, bonus, size, STEPS=max_depth, BLOCK_N=_next_power_of_2(size), num_warps=TREE_WARPS)
    return path, lengths, bonus, committed


def commit_entries(storage: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor,
                   counts: torch.Tensor, lengths: torch.Tensor) -> None:
    """``kv_cache.KVCache.commit`` in one kernel (one program per row and layer x k/v): storage
    ``[layers, 2, slots, kv_heads, capacity, head_dim]``; entry ``starts[b] + keep[b, j]`` of slot
    ``slots[b]`` moves to ``starts[b] + j`` for j < P (keep: ``[B, P]``), and the slot's committed
    length becomes ``lengths[slots[b]] = starts[b] + counts[b]`` (lengths: ``[slots]`` int64)."""
    layers, _, max_slots, heads, capacity, head_dim = storage.shape
    rows, n_keep = keep.shape
    if not storage.is_contiguous():
        raise ValueError("commit_entries needs a contiguous KV storage")
    if lengths.dtype != torch.long or not lengths.is_contiguous():
        raise ValueError(f"commit_entries needs contiguous int64 lengths, got {lengths.dtype}")
    _kernels()._commit_kernel[(rows, layers * 2)](
        storage, slots.contiguous(), starts.contiguous(), keep.long().contiguous(), counts.long().contiguous(),
        lengths, n_keep, heads * capacity * head_dim, max_slots * heads * capacity * head_dim, capacity, heads,
        head_dim, BLOCK_P=_next_power_of_2(n_keep), BLOCK_H=_next_power_of_2(heads),
        BLOCK_D=_next_power_of_2(head_dim), num_warps=4)


LOGSUMEXP_CHUNK = 4096  # vocabulary entries per program of the per-chunk kernels of log_normalize_top and top_log_probs


def log_normalize_top(logits: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
    """``top_values - logsumexp(logits)`` per row in float32, reading the logits once in their own
    dtype (no float32 copy): logits ``[..., V]``, top_values ``[..., K]`` (any K values of each
    row, e.g. its top-k) -> ``[..., K]`` float32 log-probabilities."""
    vocab, k = logits.shape[-1], top_values.shape[-1]
    rows = logits.numel() // vocab
    chunks = -(-vocab // LOGSUMEXP_CHUNK)
    parts = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    out = torch.empty(*top_values.shape, dtype=torch.float32, device=logits.device)
    _kernels()._partial_logsumexp_kernel[(rows, chunks)](logits.contiguous(), parts, vocab, chunks,
                                                         BLOCK=LOGSUMEXP_CHUNK, num_warps=8)
    _kernels()._normalize_top_kernel[(rows,)](parts, top_values.contiguous(), out, k, chunks,
                                              BLOCK_C=_next_power_of_2(chunks), BLOCK_K=_next_power_of_2(k))
    return out


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of bf16 / fp16 ``logits [..., V]`` as float32 log-probabilities
    (``x - logsumexp(row)``) and token ids, ``[..., k]`` each, best first; equal values in index
    order. An exact radix select over the 16-bit order keys (``triton_kernels``, "exact top-k of
    16-bit logits"): every kernel but the last reads the logits in their own dtype, chunked over
    the vocabulary, and the log-normalizer comes from the same pass as the first histogram."""
    if logits.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"top_log_probs needs bf16 or fp16 logits, got {logits.dtype}")
    vocab = logits.shape[-1]
    if not 0 < k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    logits = logits.contiguous()
    rows = logits.numel() // vocab
    chunks = -(-vocab // LOGSUMEXP_CHUNK)
    device = logits.device
    parts = torch.empty(rows, chunks, 2, dtype=torch.float32, device=device)
    high_hist, low_hist = (torch.empty(rows, chunks, 256, dtype=torch.int32, device=device) for _ in range(2))
    select = torch.empty(rows, 4, dtype=torch.int32, device=device)
    offsets = torch.empty(rows, chunks, 2, dtype=torch.int32, device=device)
    picked = torch.empty(rows, k, dtype=torch.int64, device=device)
    logp = torch.empty(*logits.shape[:-1], k, dtype=torch.float32, device=device)
    tokens = torch.empty(*logits.shape[:-1], k, dtype=torch.int64, device=device)
    kernels, grid, block_c = _kernels(), (rows, chunks), _next_power_of_2(chunks)
    per_chunk = dict(BLOCK=LOGSUMEXP_CHUNK, num_warps=8)
    kernels._topk_high_histogram_kernel[grid](logits, parts, high_hist, vocab, chunks, **per_chunk)
    kernels._topk_high_byte_kernel[(rows,)](high_hist, select, k, chunks, BLOCK_C=block_c)
    kernels._topk_low_histogram_kernel[grid](logits, select, low_hist, vocab, chunks, **per_chunk)
    kernels._topk_threshold_kernel[(rows,)](high_hist, low_hist, select, offsets, k, chunks, BLOCK_C=block_c)
    kernels._topk_gather_kernel[grid](logits, select, offsets, picked, vocab, chunks, k, **per_chunk)
    kernels._topk_sort_kernel[(rows,)](logits, picked, parts, logp, tokens, vocab, k, chunks,
                                       BLOCK_K=_next_power_of_2(k), BLOCK_C=block_c)
    return logp, tokens
