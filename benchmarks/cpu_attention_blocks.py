"""CPU: the tree attention kernel with scores of 8 keys at a time (``key_blocks``, the default)
against one dot product per key, the same bits (tests/test_cpu_kernels.py).

Two measurements, old and new interleaved in blocks (this VM's speed drifts by tens of percent
between runs, so only interleaved pairs compare):
- ``kernel``: one attention call at SmolLM2's shape (9 heads, 3 KV heads, head_dim 64), cache-warm;
- ``forward``: whole SmolLM2 target forwards of 1 and 5 new tokens (a plain step, a DDTree-4
  verify) at a context of 200 and 450 committed tokens, as in the engine, and the attention
  calls' share of them.

    python benchmarks/cpu_attention_blocks.py [--blocks 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import flashtree
from flashtree.bench.environment import environment
from flashtree.models import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_forward_by_tokens import forward  # noqa: E402  (one target forward at a context)

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_attention_blocks.json"
CASES = ((1, 200), (5, 200), (1, 450), (5, 450))  # (new tokens, committed context)


def kernel_call(n: int, context: int, key_blocks: bool, generator: torch.Generator):
    k_cache, v_cache = torch.randn(2, 2, 3, context + n + 8, 64, generator=generator).unbind(0)
    q = torch.randn(1, 9, n, 64, generator=generator)
    mask = torch.ones(1, n, n, dtype=torch.bool).tril()
    args = (q, k_cache, v_cache, torch.tensor([1]), torch.tensor([context]), mask)
    return lambda: cpu_kernels.tree_attention(*args, key_blocks=key_blocks)


def time_calls(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def kernel_rows(blocks: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n, context in CASES:
        fns = {kb: kernel_call(n, context, kb, generator) for kb in (False, True)}
        samples = {False: [], True: []}
        for _ in range(blocks):
            for kb in (False, True):
                time_calls(fns[kb], 20)
                samples[kb].append(time_calls(fns[kb], 200) * 1e6)
        rows.append(summary_row("kernel", n, context, samples, "us"))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def forward_rows(blocks: int) -> list[dict]:
    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=1024)
    model, cache = llm.engine.model, llm.engine.runner.cache
    real = cpu_kernels.tree_attention
    attention_seconds = [0.0]

    def timed_attention(*args, key_blocks, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, key_blocks=key_blocks, **kwargs)
        finally:
            attention_seconds[0] += time.perf_counter() - start

    rows = []
    for n, context in CASES:
        samples = {False: [], True: []}
        attention = {False: [], True: []}
        for _ in range(blocks):
            for kb in (False, True):
                cpu_kernels.tree_attention = lambda *a, _kb=kb, **k: timed_attention(*a, key_blocks=_kb, **k)
                try:
                    time_calls(lambda: forward(model, cache, n, context), 2)
                    attention_seconds[0] = 0.0
                    samples[kb].append(time_calls(lambda: forward(model, cache, n, context), 10) * 1e3)
                    attention[kb].append(attention_seconds[0] / 10 * 1e3)
                finally:
                    cpu_kernels.tree_attention = real
        rows.append(summary_row("forward", n, context, samples, "ms"))
        rows.append(summary_row("attention calls in the forward", n, context, attention, "ms"))
        print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
    return rows


def summary_row(what: str, n: int, context: int, samples: dict, unit: str) -> dict:
    """Medians of each side and the median of the per-block ratios (new / old)."""
    ratios = [new / old for old, new in zip(samples[False], samples[True])]
    return {"what": what, "new_tokens": n, "context": context, "unit": unit,
            "per_key": round(statistics.median(samples[False]), 3),
            "key_blocks": round(statistics.median(samples[True]), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=12, help="interleaved (per key, key blocks) pairs per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = kernel_rows(args.blocks) + forward_rows(args.blocks)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "blocks": args.blocks, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
