"""H200: what the first SDPA call at a new shape costs, per attention backend, at the shapes of
tree-verify rounds (Qwen3-8B heads, bf16, an additive mask).

Why: on the H200 a round that meets a new shape costs 85-250 ms eagerly and 0.1-0.3 s when it
captures a CUDA graph (benchmarks/journal/session-10-2026-12-02.md), against 6-8 ms when replayed. PyTorch
picks cuDNN attention for these masked shapes, and cuDNN builds an execution plan per new shape;
36 layers share one plan per shape, so a plan that takes tens of ms would explain it. This times,
per shape, the first call and the median of the next ``--calls`` for each backend (each backend on
its own key lengths, so no backend meets a shape another one has warmed).

    PYTHONPATH=. python benchmarks/gpu_sdpa_first_call.py [--rows 1,4,16,32] [--tokens 5,17,65]
        [--keys 512,1024] [--backends default,cudnn,efficient] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def tree_bias(rows: int, tokens: int, keys: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[B, 1, N, K]`` additive bias: every committed key visible, the N new keys causal (a chain:
    the cost does not depend on which tree)."""
    allowed = torch.ones(rows, 1, tokens, keys, dtype=torch.bool, device=device)
    allowed[..., keys - tokens:] = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_first_call(attend, rows: int, tokens: int, keys: int, calls: int, dtype, device: str) -> dict:
    """``attend(q, k, v, bias)`` on random inputs of one shape (Qwen3-8B heads, :func:`tree_bias`):
    its first call and the median of the next ``calls``, in ms."""
    q = torch.randn(rows, HEADS, tokens, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(rows, KV_HEADS, keys, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    bias = tree_bias(rows, tokens, keys, dtype, device)
    times = []
    for _ in range(calls + 1):
        sync(device)
        start = time.perf_counter()
        attend(q, k, v, bias)
        sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return {"rows": rows, "tokens": tokens, "keys": keys, "first_ms": round(times[0], 3),
            "then_ms": round(statistics.median(times[1:]), 4)}


def time_shape(backend, rows: int, tokens: int, keys: int, calls: int, dtype, device: str) -> dict:
    """:func:`time_first_call` of SDPA with ``backend`` only (None: PyTorch's own choice)."""

    def attend(q, k, v, bias):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    return time_first_call(attend, rows, tokens, keys, calls, dtype, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--tokens", default="5,17,65")
    parser.add_argument("--keys", default="512,1024")
    parser.add_argument("--backends", default="default,cudnn,efficient")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "results": {}}
    for index, name in enumerate(args.backends.split(",")):
        rows_out = []
        for rows in (int(r) for r in args.rows.split(",")):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for keys in (int(k) + index for k in args.keys.split(",")):  # its own key lengths
                    try:
                        rows_out.append(time_shape(BACKENDS[name], rows, tokens, keys, args.calls, dtype, args.device))
                    except RuntimeError as err:  # a backend that does not take this shape
                        rows_out.append({"rows": rows, "tokens": tokens, "keys": keys, "error": str(err)[:200]})
                    print(name, json.dumps(rows_out[-1]), flush=True)
        out["results"][name] = rows_out
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
