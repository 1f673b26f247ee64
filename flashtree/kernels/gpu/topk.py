"""The drafter logits' per-depth top-k with log-probabilities on CUDA."""

from __future__ import annotations

import functools

import torch

from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_topk

    return triton_topk


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
    order. An exact radix select over the 16-bit order keys (``triton_topk``, "exact top-k of
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
