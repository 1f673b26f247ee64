"""Where a plain decode step's time goes on the CPU (SmolLM2, fp32, batch 1, 2 threads).

Wall-clock accumulators are wrapped around the leaf pieces of a step (the matmuls, RMSNorm,
rotary, attention, KV writes and commit, sampling, the ``.tolist()`` sync, the host work) by
patching functions in this process only; "glue" is the rest of the forward / step (Python, module
calls, views, residual adds). The wrappers cost about 1 us per call (about 0.4 ms per token).
It also times a small op alone and right after a large matmul: on this machine a large GEMV
evicts the caches, and the next small op pays for it.

    python benchmarks/cpu_profile_plain.py [--new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_profile_plain.json"
PROMPT = "Write a short story about a robot who learns to paint."
IN_FORWARD = ("matmul", "rmsnorm", "silu", "attention", "rotary", "kv write", "kv view")
seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter = collections.Counter()


def timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
    return wrapper


def wrap(owner, name: str, label: str, static: bool = False) -> None:
    """Time ``owner.name`` (a missing one is an error: the engine's internals move, and a piece
    left unwrapped would silently land in the glue)."""
    fn = getattr(owner, name, None)
    if fn is None:
        raise AttributeError(f"{getattr(owner, '__name__', owner)} has no {name!r} to time: update install_timers")
    setattr(owner, name, staticmethod(timed(label, fn)) if static else timed(label, fn))


def install_timers(model) -> None:
    import flashtree.engine.engine as engine_module
    import flashtree.engine.prefill as prefill_module
    import flashtree.engine.round as round_module
    import flashtree.engine.runner as runner_module
    import flashtree.engine.scheduler as scheduler_module
    import flashtree.kv.cache as kv_module
    import flashtree.models.transformer as transformer_module

    dense = F.linear
    head = model.lm_head.weight

    def linear(x, weight, bias=None):
        label = "matmul: lm_head" if weight is head else "matmul: layer linears"
        start = time.perf_counter()
        out = dense(x, weight, bias)
        seconds[label] += time.perf_counter() - start
        calls[label] += 1
        return out

    torch.nn.functional.linear = linear

    from flashtree.kernels.cpu.quant_linear import QuantizedLinear  # the GGUF-block kernel (kernels on)

    block_call = QuantizedLinear.__call__

    def block_linear(self, x, bias=None):
        label = "matmul: lm_head (GGUF blocks)" if self is model.lm_head_quant else "matmul: layer linears (GGUF blocks)"
        start = time.perf_counter()
        out = block_call(self, x, bias)
        seconds[label] += time.perf_counter() - start
        calls[label] += 1
        return out

    QuantizedLinear.__call__ = block_linear
    wrap(torch.nn.functional, "rms_norm", "rmsnorm")
    wrap(torch.nn.functional, "silu", "silu")
    wrap(transformer_module, "masked_attention", "attention (sdpa)")
    wrap(transformer_module, "apply_rotary", "rotary")
    wrap(transformer_module, "attention_mask", "attention mask build")
    wrap(kv_module.KVCache, "write_at", "kv write (index_put)")
    wrap(kv_module.KVCache, "view", "kv view")
    wrap(kv_module.KVCache, "commit", "kv commit (gather + scatter)")
    wrap(round_module, "choose_tokens", "sampling (argmax)")  # the round's
    wrap(prefill_module, "choose_tokens", "sampling (argmax)")  # the prefill's first token
    wrap(round_module, "accept_walk", "accept walk")
    wrap(runner_module.ModelRunner, "_to_host", ".tolist() (the one host sync)", static=True)
    wrap(runner_module.ModelRunner, "_round_inputs", "round inputs (host lists -> tensors)")
    wrap(engine_module, "append_tokens", "append_tokens (stop checks, detokenize)")
    wrap(scheduler_module.Scheduler, "schedule", "scheduler")
    model.__class__.forward = timed("FORWARD", model.__class__.forward)


def decode_once(engine, prompt_ids, new_tokens: int) -> tuple[float, dict, dict]:
    from flashtree import SamplingParams

    req = engine.add_request(prompt_ids, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
    while not req.output_ids:
        engine.step()
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    while not req.finished:
        engine.step()
    wall = time.perf_counter() - start
    engine.step()  # frees the slot
    return wall, dict(seconds), dict(calls)


def breakdown(wall: float, leaves: dict, counts: dict, tokens: int) -> list[dict]:
    forward = leaves.pop("FORWARD")
    inside = sum(v for k, v in leaves.items() if k.startswith(IN_FORWARD))
    outside = sum(v for k, v in leaves.items() if not k.startswith(IN_FORWARD))
    rows = [(k, v, counts.get(k, 0)) for k, v in sorted(leaves.items(), key=lambda item: -item[1])]
    rows.append(("forward glue (Python, module calls, views, residual adds, embedding, rotary lookup)", forward - inside, 0))
    rows.append(("step glue (engine Python outside the pieces above)", wall - forward - outside, 0))
    return [{"piece": k, "ms_per_token": round(1000 * v / tokens, 3), "share": round(v / wall, 4),
             "calls_per_token": round(n / tokens, 1)} for k, v, n in rows]


def cold_op_cost() -> dict:
    """Microseconds of small ops alone vs right after a 7 MB GEMV (one decode layer's gate_up)."""
    x, weight = torch.randn(1, 1, 576), torch.ones(576)
    big = [torch.randn(3072, 576) for _ in range(30)]
    ops = {"rms_norm": lambda: F.rms_norm(x, (576,), weight, 1e-5), "add": lambda: x + x}
    result = {}
    with torch.inference_mode():
        for name, op in ops.items():
            for after_gemv in (False, True):
                total = 0.0
                for i in range(300):
                    if after_gemv:
                        torch.nn.functional.linear(x, big[i % 30])
                    start = time.perf_counter()
                    op()
                    total += time.perf_counter() - start
                result[f"{name} {'after GEMV' if after_gemv else 'alone'} (us)"] = round(total / 300 * 1e6, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="decodes; the fastest is reported")
    parser.add_argument("--quant-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="the GGUF-block products (--no-quant-kernels: profile the fp32-only engine)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import flashtree
    from flashtree.bench.environment import environment
    from flashtree.models.tokenizer import encode_chat

    cold = cold_op_cost()
    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=1024,
                        quant_kernels=args.quant_kernels)
    install_timers(llm.engine.model)
    prompt_ids = encode_chat(llm.tokenizer, [{"role": "user", "content": PROMPT}])
    wall, leaves, counts = min((decode_once(llm.engine, prompt_ids, args.new_tokens) for _ in range(args.repeats)),
                               key=lambda run: run[0])
    rows = breakdown(wall, leaves, counts, args.new_tokens)
    ms_per_token = 1000 * wall / args.new_tokens
    print(f"plain decode: {ms_per_token:.2f} ms/token ({args.new_tokens / wall:.1f} tokens/s), "
          f"prompt {len(prompt_ids)} tokens, {args.new_tokens} new, fastest of {args.repeats}")
    print("| piece | ms/token | share | calls/token |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['piece']} | {row['ms_per_token']:.3f} | {100 * row['share']:.1f}% | {row['calls_per_token']} |")
    print("small op cost:", cold)
    config = {**environment(torch.device("cpu")), "threads": args.threads, "new_tokens": args.new_tokens,
              "prompt_tokens": len(prompt_ids), "quant_kernels": llm.engine.model.lm_head_quant is not None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "ms_per_token": round(ms_per_token, 3), "pieces": rows,
                                    "small_op_cost": cold}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
