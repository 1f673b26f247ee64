"""Time to first token with a shared system prompt, with and without automatic prefix caching.

The first request (a ``--system-tokens`` system prompt and a question) runs alone; then
``--requests - 1`` more requests with the same system prompt and other questions arrive together.
Reports each request's time to first token (arrival -> first output token, engine steps only, no
HTTP), and the ratio of requests 2..N to the first, with prefix caching on and off (issue #39's
target: <= 0.25x with it on). Greedy, 4 new tokens each. ``--repeats N``: N system prompts one after another in
the same engine, each ratio reported and their median (one run's ratio moved 2x between machines on an H100).

    python benchmarks/prefix_cache_ttft.py --model smollm2 --out benchmarks/results/prefix_cache_ttft_cpu.json
    python benchmarks/prefix_cache_ttft.py --model /tmp/qwen3-8b --random-weights --device cuda --out ...
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams

PARAGRAPH = ("You are a careful assistant for a software team. Answer with short, correct statements, cite the "
             "file and the function you mean, never invent an API, and say so when you do not know. ")


def prompts(llm: LLM, system_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: the same ``system_tokens``-token system prompt (one per ``seed``), then a question of
    their own."""
    if llm.tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        system = torch.randint(0, llm.engine.model.config.vocab_size, (system_tokens,), generator=gen).tolist()
        return [system + [i + 1, i + 2, i + 3] for i in range(1, count + 1)]
    text = f"Session {seed}. " + PARAGRAPH * (system_tokens // 30 + 1)
    system = llm.tokenizer.encode(text)[:system_tokens]
    return [system + llm.tokenizer.encode(f" Question {i}: what does function number {i} return?")
            for i in range(count)]


def first_token_times(llm: LLM, batch: list[list[int]]) -> list[float]:
    """Seconds from adding each prompt (all at once) to its first output token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in batch]
    firsts: dict[int, float] = {}
    while len(firsts) < len(reqs):
        engine.step()
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            if r.output_ids and i not in firsts:
                firsts[i] = now - start
    engine.run_until_done(reqs)
    return [firsts[i] for i in range(len(reqs))]


def run(args, caching: bool) -> dict:
    """Per repeat (a system prompt of its own): the first request alone, then the others together."""
    llm = LLM(args.model, device=args.device, random_weights=args.random_weights, max_running=args.requests,
              max_context=args.system_tokens + 64, prefill_chunk=args.prefill_chunk,
              max_prefill_tokens=args.prefill_chunk, prefix_caching=caching, triton_attention=args.triton_attention)
    first_token_times(llm, [prompts(llm, 8, 1, seed=10_000)[0]])  # warm-up on an unrelated short prompt
    repeats = []
    for seed in range(args.repeats):
        batch = prompts(llm, args.system_tokens, args.requests, seed)
        first = first_token_times(llm, batch[:1])[0]
        rest = first_token_times(llm, batch[1:])
        repeats.append({"first_s": first, "rest_s": rest, "rest_mean_s": statistics.mean(rest),
                        "rest_max_s": max(rest), "rest_mean_over_first": statistics.mean(rest) / first})
    if args.profile and caching:  # the kernels of one more repeat's batch, from admission to the first tokens
        from torch.profiler import ProfilerActivity, profile

        batch = prompts(llm, args.system_tokens, args.requests, args.repeats)
        first_token_times(llm, batch[:1])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            first_token_times(llm, batch[1:])
        Path(args.profile).write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25) +
                                      prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    return {"prefix_caching": caching, **repeats[0], "repeats": repeats,
            "median_rest_over_first": statistics.median(r["rest_mean_over_first"] for r in repeats),
            "cached_tokens": llm.engine.prefix_cache.hit_tokens if caching else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--triton-attention", choices=("auto", "on"), default="auto",
                        help="KernelConfig.triton_attention: on, prompt chunks attend through the paged kernel too")
    parser.add_argument("--repeats", type=int, default=1, help="system prompts measured one after another")
    parser.add_argument("--short-prefill-tokens", type=int, default=None,
                        help="models.transformer.SHORT_PREFILL_TOKENS (0: every prompt chunk through SDPA over "
                             "gathered pages, as before 2026-12-07)")
    parser.add_argument("--profile", help="write the kernel and host-op tables of one more batch (caching on) here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.triton_attention = {"auto": None, "on": True}[args.triton_attention]
    if args.short_prefill_tokens is not None:
        from flashtree.models import transformer

        transformer.SHORT_PREFILL_TOKENS = args.short_prefill_tokens
    results = [run(args, caching) for caching in (True, False)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else platform.processor()
    out = {"device": device or platform.machine(), "model": args.model, "system_tokens": args.system_tokens,
           "requests": args.requests, "runs": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r in results:
        ratios = ", ".join(f"{x['rest_mean_over_first']:.3f}" for x in r["repeats"])
        print(f"prefix caching {'on ' if r['prefix_caching'] else 'off'}: first {r['first_s'] * 1000:.0f} ms, "
              f"requests 2..{args.requests} mean {r['rest_mean_s'] * 1000:.0f} ms (max {r['rest_max_s'] * 1000:.0f}), "
              f"{r['rest_mean_over_first']:.3f}x the first; every repeat: {ratios} (median "
              f"{r['median_rest_over_first']:.3f}x)")

if __name__ == "__main__":
    main()
