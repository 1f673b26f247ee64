"""H200: what a prefill at a new shape costs, with PyTorch's attention choice (cuDNN, which builds
an execution plan per new shape) and with the planless path prefill now takes
(``flashtree.models.attention.planless_attention``: the memory-efficient kernel on folded
query groups).

Why: served step traces (benchmarks/journal/session-11-2026-12-02.md) show one-row prefills of short
chat prompts at 13-43 ms, and some at 40-200 ms, against about 6 ms for a graphed decode step;
``gpu_sdpa_first_call.py`` measured 40-65 ms for cuDNN's first call at each new shape.

1. ``attention``: one SDPA call at prefill shapes (Qwen3-8B heads, bf16, a causal bias over the
   cached keys), first call and the median of the next ``--calls``, per path, each path on its
   own key lengths. Besides cuDNN and the planless path, three variants locate the planless
   path's floor (0.18 ms a call at small shapes in the eleventh session): the efficient kernel
   alone (an error if it refuses, i.e. the planless path fell back to math), keys padded to a
   multiple of 16, and KV heads repeated instead of query groups folded.
2. ``engine``: Qwen3-8B shape, random bf16 weights, plain decoding, eager prefill: the wall time
   of a request with one output token (its prefill), for prompts of ``--lengths`` one at a time,
   then the same lengths again (shapes seen), then ``--batch`` prompts together; per path
   (``KernelConfig.planless_prefill``: one engine per path over one loaded target), the planless
   one first.

    PYTHONPATH=. python benchmarks/gpu_prefill_shapes.py [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sdpa_first_call import HEAD_DIM, HEADS, KV_HEADS, sync, time_first_call, tree_bias  # noqa: E402
from qwen3_8b_shape import QWEN3_8B, write_config  # noqa: E402

from flashtree.config import EngineConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.models.attention import masked_attention, planless_attention  # noqa: E402
from flashtree.models.build import load_target, resolve_dtype  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402


def efficient_only(q, k, v, bias):
    """The planless path without its math fallback: raises where the efficient kernel refuses."""
    return planless_attention(q, k, v, bias, backends=[SDPBackend.EFFICIENT_ATTENTION])


def keys_aligned(q, k, v, bias, multiple=16):
    """The planless path with the keys padded to a multiple of 16 (masked), so PyTorch need not
    pad the bias on every call."""
    pad = -k.shape[2] % multiple
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        bias = F.pad(bias, (0, pad), value=float("-inf"))
    return planless_attention(q, k, v, bias)


def expanded_kv(q, k, v, bias):
    """No fold: the KV heads repeated to the query heads, the efficient kernel only."""
    groups = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=bias)


# what prefill ran before, what it runs now, and three variants that locate the planless floor
PATHS = {"cudnn": masked_attention, "planless": planless_attention, "efficient_only": efficient_only,
         "keys_aligned": keys_aligned, "expanded_kv": expanded_kv}


def attention_part(rows_list, new_list, cached_list, calls) -> dict:
    out = {}
    for index, (name, path) in enumerate(PATHS.items()):
        path(*(torch.randn(1, h, 8, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for h in (HEADS, KV_HEADS, KV_HEADS)),
             tree_bias(1, 8, 8, torch.bfloat16, "cuda"))  # library and kernel loading, outside the timings
        rows_out = []
        for rows in rows_list:
            for new in new_list:
                for cached in cached_list:
                    keys = new + cached + index
                    try:
                        rows_out.append(time_first_call(path, rows, new, keys, calls, torch.bfloat16, "cuda"))
                    except RuntimeError as err:  # a kernel that refuses this shape
                        rows_out.append({"rows": rows, "tokens": new, "keys": keys, "error": str(err)[:200]})
                    print(name, json.dumps(rows_out[-1]), flush=True)
        out[name] = rows_out
    return out


def prefill_ms(engine: LLMEngine, lengths: list[int], gen: torch.Generator) -> float:
    """Wall ms until every prompt of ``lengths`` (added together) has its one output token."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    sync("cuda")
    start = time.perf_counter()
    reqs = [engine.add_request(torch.randint(0, engine.model.config.vocab_size, (n,), generator=gen).tolist(), params) for n in lengths]
    while any(len(r.output_ids) == 0 for r in reqs):
        engine.step()
    sync("cuda")
    ms = (time.perf_counter() - start) * 1000
    while engine.has_work:
        engine.step()
    return round(ms, 2)


def engine_part(lengths, batch_lengths) -> dict:
    target = write_config("/tmp/flashtree-qwen3-8b", QWEN3_8B)
    base = EngineConfig.of(model=str(target), random_weights=True, device="cuda", max_running=32, max_context=2048)
    device = torch.device("cuda")
    loaded = load_target(base, device, resolve_dtype(base.target.dtype, device))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for planless in (True, False):
        kernels = dataclasses.replace(base.kernels, planless_prefill=planless)
        engine = LLMEngine(dataclasses.replace(base, kernels=kernels), target=loaded)
        name = "planless" if planless else "cudnn"
        prefill_ms(engine, [7], gen)  # a length outside the lists: library and kernel loading
        first = {n: prefill_ms(engine, [n], gen) for n in lengths}
        again = {n: prefill_ms(engine, [n], gen) for n in lengths}
        batched_first = prefill_ms(engine, batch_lengths, gen)
        batched_again = prefill_ms(engine, batch_lengths, gen)
        out[name] = {"one_prompt_first_ms": first, "one_prompt_again_ms": again,
                     "batch_first_ms": batched_first, "batch_again_ms": batched_again}
        print(name, json.dumps(out[name]), flush=True)
        del engine  # (its KV cache) before the next path's engine
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--new", default="37,101,250,512")
    parser.add_argument("--cached", default="0,300")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--lengths", default="19,45,83,128,190,257,333,410,500,777,1000")
    parser.add_argument("--batch", default="23,61,88,140,201,266,301,399", help="prompt lengths prefilled together")
    parser.add_argument("--skip", default="", help="attention or engine")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "attention" not in args.skip:
        out["attention"] = attention_part(ints(args.rows), ints(args.new), ints(args.cached), args.calls)
    if "engine" not in args.skip:
        out["engine"] = engine_part(ints(args.lengths), ints(args.batch))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
