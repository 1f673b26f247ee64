"""Triton kernels of the drafter logits' top-k (behind :mod:`flashtree.kernels.gpu.topk`): the log-normalizer
by vocabulary chunks and an exact radix select over 16-bit order keys."""

import triton
import triton.language as tl


@triton.jit
def _partial_logsumexp_kernel(x_ptr, part_ptr, vocab, chunks, BLOCK: tl.constexpr):
    """One (row, vocabulary chunk): the chunk's max and its sum of exp(x - max), in float32."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(x_ptr + row * vocab + cols, mask=inside, other=float("-inf")).to(tl.float32)
    _store_max_and_sum(part_ptr + (row * chunks + chunk) * 2, x, inside)


@triton.jit
def _store_max_and_sum(part_ptr, x, inside):
    """A vocabulary chunk's (max, sum of exp(x - max)) pair, float32, to ``part_ptr[0:2]``."""
    top = tl.max(x, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)  # a chunk of -inf only sums to 0
    tl.store(part_ptr, top)
    tl.store(part_ptr + 1, tl.sum(tl.where(inside, tl.exp(x - safe), 0.0), axis=0))


@triton.jit
def _log_normalizer(part_ptr, row, chunks, BLOCK_C: tl.constexpr):
    """A row's logsumexp from its chunks' (max, sum) pairs (``part_ptr``: [rows, chunks, 2])."""
    c = tl.arange(0, BLOCK_C)
    c_ok = c < chunks
    tops = tl.load(part_ptr + (row * chunks + c) * 2, mask=c_ok, other=float("-inf"))
    sums = tl.load(part_ptr + (row * chunks + c) * 2 + 1, mask=c_ok, other=0.0)
    top = tl.max(tops, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log(tl.sum(sums * tl.exp(tops - safe), axis=0))


@triton.jit
def _normalize_top_kernel(part_ptr, top_ptr, out_ptr, k, chunks, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row: its log-normalizer from the chunks' (max, sum) pairs, then the top values minus it."""
    row = tl.program_id(0).to(tl.int64)
    log_norm = _log_normalizer(part_ptr, row, chunks, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < k
    values = tl.load(top_ptr + row * k + j, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * k + j, values - log_norm, mask=j_ok)


# ---------------------------------------------------------------------------- exact top-k of 16-bit logits
# A radix select over each row's 16-bit order keys (high byte, then low byte), in six kernels
# (topk.top_log_probs): per vocabulary chunk the max, the sum of exponentials and a histogram
# of high bytes; per row the high byte of the k-th largest key; per chunk a histogram of low bytes
# inside that high byte; per row the k-th largest key and each chunk's output places; per chunk the
# selected entries (all keys above it, then the first ties at it by index); per row their sort.
# (Five kernels, each chunk program finding the high byte itself, and other chunk sizes than 4,096
# were slower on the H200.)


@triton.jit
def _order_key16(raw):
    """The 16-bit order key of bf16 / fp16 values ``raw`` (int32 in [0, 65536), ascending as the
    values; -0.0 and +0.0 share one key, as equal values)."""
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 -> +0.0
    return tl.where(bits < 0x8000, bits | 0x8000, (~bits) & 0xFFFF)


@triton.jit
def _chunk_keys(x_ptr, row, chunk, vocab, BLOCK: tl.constexpr):
    """One (row, chunk): its column indices, which are inside the vocabulary, raw values and keys."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    raw = tl.load(x_ptr + row * vocab + cols, mask=inside, other=float("-inf"))
    return cols, inside, raw, _order_key16(raw)


@triton.jit
def _topk_high_histogram_kernel(x_ptr, part_ptr, hist_ptr, vocab, chunks, BLOCK: tl.constexpr):
    """One (row, chunk): max and sum of exp(x - max) in float32, and the histogram of key high bytes."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols, inside, raw, key = _chunk_keys(x_ptr, row, chunk, vocab, BLOCK)
    _store_max_and_sum(part_ptr + (row * chunks + chunk) * 2, raw.to(tl.float32), inside)
    bins = tl.arange(0, 256)
    hist = tl.histogram(tl.where(inside, key >> 8, 0), 256)  # padding counted in bin 0, then removed
    hist -= tl.where(bins == 0, tl.sum((~inside).to(tl.int32), axis=0), 0)
    tl.store(hist_ptr + (row * chunks + chunk) * 256 + bins, hist)


@triton.jit
def _suffix_counts(hist):
    """counts[b] = number of keys in bins >= b, for a [256] histogram."""
    return tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist


@triton.jit
def _topk_high_byte_kernel(hist_ptr, select_ptr, k, chunks, BLOCK_C: tl.constexpr):
    """One row: the high byte of its k-th largest key and the number of keys in higher bytes."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    bins = tl.arange(0, 256)
    hists = tl.load(hist_ptr + (row * chunks + c[:, None]) * 256 + bins[None, :], mask=(c < chunks)[:, None], other=0)
    hist = tl.sum(hists, axis=0)  # [256]
    high = tl.max(tl.where(_suffix_counts(hist) >= k, bins, 0), axis=0)
    tl.store(select_ptr + row * 4, high)
    tl.store(select_ptr + row * 4 + 1, tl.sum(tl.where(bins > high, hist, 0), axis=0))


@triton.jit
def _topk_low_histogram_kernel(x_ptr, select_ptr, hist_ptr, vocab, chunks, BLOCK: tl.constexpr):
    """One (row, chunk): the histogram of key low bytes among keys whose high byte is the row's."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols, inside, raw, key = _chunk_keys(x_ptr, row, chunk, vocab, BLOCK)
    high = tl.load(select_ptr + row * 4)
    in_byte = inside & ((key >> 8) == high)
    bins = tl.arange(0, 256)
    hist = tl.histogram(tl.where(in_byte, key & 0xFF, 0), 256)  # the others counted in bin 0, then removed
    hist -= tl.where(bins == 0, tl.sum((~in_byte).to(tl.int32), axis=0), 0)
    tl.store(hist_ptr + (row * chunks + chunk) * 256 + bins, hist)


@triton.jit
def _topk_threshold_kernel(high_hist_ptr, low_hist_ptr, select_ptr, offsets_ptr, k, chunks, BLOCK_C: tl.constexpr):
    """One row: its k-th largest key T (``select[row, 0]``; ``[1]``: keys above T; ``[2]``: ties at
    T to take), and per chunk where its keys above T and its ties go (``offsets[row, chunk]``)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < chunks
    bins = tl.arange(0, 256)
    at = (row * chunks + c[:, None]) * 256 + bins[None, :]  # [BLOCK_C, 256]
    low_hists = tl.load(low_hist_ptr + at, mask=c_ok[:, None], other=0)
    high = tl.load(select_ptr + row * 4)
    above_byte = tl.load(select_ptr + row * 4 + 1)
    low_hist = tl.sum(low_hists, axis=0)
    low = tl.max(tl.where(_suffix_counts(low_hist) >= k - above_byte, bins, 0), axis=0)
    above = above_byte + tl.sum(tl.where(bins > low, low_hist, 0), axis=0)
    tl.store(select_ptr + row * 4, high * 256 + low)
    tl.store(select_ptr + row * 4 + 1, above)
    tl.store(select_ptr + row * 4 + 2, k - above)
    high_hists = tl.load(high_hist_ptr + at, mask=c_ok[:, None], other=0)
    chunk_above = tl.sum(tl.where(bins[None, :] > high, high_hists, 0), axis=1) + \
        tl.sum(tl.where(bins[None, :] > low, low_hists, 0), axis=1)  # [BLOCK_C]
    chunk_ties = tl.sum(tl.where(bins[None, :] == low, low_hists, 0), axis=1)
    out = offsets_ptr + (row * chunks + c) * 2
    tl.store(out, tl.cumsum(chunk_above, axis=0) - chunk_above, mask=c_ok)
    tl.store(out + 1, tl.cumsum(chunk_ties, axis=0) - chunk_ties, mask=c_ok)


@triton.jit
def _topk_gather_kernel(x_ptr, select_ptr, offsets_ptr, picked_ptr, vocab, chunks, k, BLOCK: tl.constexpr):
    """One (row, chunk): writes each selected entry's key above its index (int64) to its place
    among the row's k picks: keys above T in index order, then the first ties at T."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols, inside, raw, key = _chunk_keys(x_ptr, row, chunk, vocab, BLOCK)
    threshold = tl.load(select_ptr + row * 4)
    above_total = tl.load(select_ptr + row * 4 + 1)
    ties_wanted = tl.load(select_ptr + row * 4 + 2)
    above = inside & (key > threshold)
    tie = inside & (key == threshold)
    base = offsets_ptr + (row * chunks + chunk) * 2
    place_above = tl.load(base) + tl.cumsum(above.to(tl.int32), axis=0) - 1
    tie_rank = tl.load(base + 1) + tl.cumsum(tie.to(tl.int32), axis=0) - 1
    take = above | (tie & (tie_rank < ties_wanted))
    place = tl.where(above, place_above, above_total + tie_rank)
    packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)  # ties: lower index first
    tl.store(picked_ptr + row * k + place, packed, mask=take)


@triton.jit
def _topk_sort_kernel(x_ptr, picked_ptr, part_ptr, logp_ptr, tokens_ptr, vocab, k, chunks,
                      BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row: its k picks sorted (value descending, index ascending on ties), as float32
    log-probabilities (minus the log-normalizer of the chunks' (max, sum) pairs) and token ids."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < k
    packed = tl.sort(tl.load(picked_ptr + row * k + j, mask=j_ok, other=-1), 0, descending=True)
    tokens = 0x7FFFFFFF - (packed & 0xFFFFFFFF)
    log_norm = _log_normalizer(part_ptr, row, chunks, BLOCK_C)
    values = tl.load(x_ptr + row * vocab + tokens, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(logp_ptr + row * k + j, values - log_norm, mask=j_ok)
    tl.store(tokens_ptr + row * k + j, tokens, mask=j_ok)
