"""The first timed pass after start-up against the second, and CUDA-graph captures in each (issue #39).

    python benchmarks/gpu_first_pass.py --out benchmarks/results/gpu_first_pass_h200.json
    python benchmarks/gpu_first_pass.py --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter flashtree/assets/smollm2-dflash --prompts humaneval_ids.jsonl --packed-verify on --out ...

One engine per method (plain, DFlash, DDTree at fixed budgets, the adaptive default). Without
``--target``: the Qwen3-8B shape with random bf16 weights (the drafter at z-lab's Qwen3-8B-DFlash-b16
shape: it never matches, so this measures what graphs and rounds cost, not acceptance). With
``--target`` / ``--drafter`` / ``--prompts`` (a JSONL file of ``{"prompt_ids"}`` lines, e.g. from
``flashtree.bench.datasets``): a real pair on real prompts, greedy until end of turn or
``--new-tokens``, and each method's tokens are compared with plain decoding's. Per batch size, two passes
of the same prompts on that engine: tokens/s, and the graphs captured inside each timed pass
(``torch.cuda.CUDAGraph.capture_begin`` counted) and Triton kernels loaded. A gap between the passes is work
done while serving, which the user pays for. ``none`` twice in ``--methods``: the second plain engine's
tokens against the first's.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, SMOLLM2_135M, write_config  # noqa: E402

from flashtree import LLM, SamplingParams  # noqa: E402

captures = 0
_capture_begin = torch.cuda.CUDAGraph.capture_begin
collections: list[tuple[int, float]] = []  # (generation, seconds) of every garbage collection so far
_collection_started = [0.0]


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _collection_started[0] = time.perf_counter()
    else:
        collections.append((info["generation"], time.perf_counter() - _collection_started[0]))


gc.callbacks.append(_time_collections)


def collections_since(start: int) -> dict:
    """The garbage collections after the ``start``-th: full ones (generation 2) and their ms, ms of all."""
    new = collections[start:]
    full = [seconds for generation, seconds in new if generation == 2]
    return {"full": len(full), "full_ms": round(1e3 * sum(full), 2), "all_ms": round(1e3 * sum(s for _, s in new), 2)}


def _counting_capture_begin(self, *args, **kwargs):
    global captures
    captures += 1
    return _capture_begin(self, *args, **kwargs)


torch.cuda.CUDAGraph.capture_begin = _counting_capture_begin

kernel_loads: list[dict] = []  # Triton kernel variants compiled or read from the disk cache (a first call of a new
# specialization): the kernel and its specialization, and the seconds the load took
_load_began = [0.0]


def _counting_jit_hook(**kwargs) -> bool:
    kernel_loads.append({"kernel": kwargs.get("repr", "?"), "seconds": None})
    _load_began[0] = time.perf_counter()
    return False  # (go on compiling)


def _timing_post_compile_hook(**kwargs) -> None:
    if kernel_loads and kernel_loads[-1]["seconds"] is None:
        kernel_loads[-1]["seconds"] = time.perf_counter() - _load_began[0]


try:
    import triton.knobs
    triton.knobs.runtime.jit_cache_hook = _counting_jit_hook
    triton.knobs.runtime.jit_post_compile_hook = _timing_post_compile_hook
except (ImportError, AttributeError):  # a Triton without knobs: no count
    pass


def method_engine(method: str, target: Path, drafter: Path, **common) -> LLM:
    """``none``, ``dflash``, ``ddtree:N`` (a fixed budget) or ``adaptive`` (DDTree, the policy's choice);
    ``common``: the engine's other keywords."""
    if method == "none":
        return LLM(str(target), **common)
    if method == "dflash":
        return LLM(str(target), spec="dflash", draft=str(drafter), adaptive_spec=False, **common)
    if method == "adaptive":
        return LLM(str(target), spec="ddtree", draft=str(drafter), **common)
    budget = int(method.split(":")[1])
    return LLM(str(target), spec="ddtree", draft=str(drafter), budget=budget, adaptive_spec=False, **common)


def allocator_calls() -> dict[str, int]:
    """The caching allocator's cudaMalloc / cudaFree calls and its retries after a failed cudaMalloc (which free
    every cached block first) so far: work a pass does for want of cached blocks."""
    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def profile_table(prof, rows: int = 25) -> dict[str, list]:
    """The profiled ops and kernels with the most self CPU time and the most self device time:
    [name, calls, self CPU ms, self device ms] each."""
    events = prof.key_averages()

    def top(key: str) -> list:
        ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
        return [[e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 2), round(e.self_device_time_total / 1e3, 2)]
                for e in ranked]

    return {"by_cpu": top("self_cpu_time_total"), "by_device": top("self_device_time_total")}


class ProductShapes(TorchDispatchMode):
    """Every eager product (aten mm / addmm / bmm / baddbmm) the process runs, by op and operand shapes and
    dtype: ``new`` lists those never seen before in the process, in order (``--product-shapes``; a cuBLAS call
    at a shape new to the process can cost far more than the next one, gpu_gemm_first_call.py)."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.seen: set = set()
        self.new: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.PRODUCTS:
            key = (func.overloadpacket.__name__,) + tuple(
                (tuple(a.shape), str(a.dtype)) for a in args if isinstance(a, torch.Tensor))
            if key not in self.seen:
                self.seen.add(key)
                self.new.append(str(key))
        return func(*args, **(kwargs or {}))


product_shapes: ProductShapes | None = None


def timed_pass(llm: LLM, prompts: list[list[int]], params: SamplingParams, profile: bool = False) -> dict:
    global captures
    before, loads_before, replay_before = captures, len(kernel_loads), llm.engine.graph_replays[1]
    shapes_before = len(product_shapes.new) if product_shapes is not None else 0
    collections_before = len(collections)
    torch.cuda.synchronize()
    allocator_before = allocator_calls()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        with profiler:
            outs = llm.generate(prompts, params)
    else:
        outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "captures": captures - before,
            "kernel_loads": kernel_loads[loads_before:],
            "allocator": {name: count - allocator_before[name] for name, count in allocator_calls().items()},
            "replay_share": (llm.engine.graph_replays[1] - replay_before) / seconds,
            "gc": collections_since(collections_before),
            "tokens": [o.token_ids for o in outs], **({"profile": profile_table(profiler)} if profile else {}),
            **({"new_product_shapes": product_shapes.new[shapes_before:]} if product_shapes is not None else {})}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="none,dflash,ddtree:16,ddtree:64,adaptive")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="random prompts' length (without --target)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--target", type=Path, help="a real target (HF folder or GGUF); default: random Qwen3-8B shape")
    parser.add_argument("--drafter", type=Path, help="the real target's DFlash drafter folder")
    parser.add_argument("--prompts", type=Path, help="with --target: JSONL of {\"prompt_ids\": [...]} lines")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--packed-verify", choices=("auto", "on", "off"), default="auto",
                        help="KernelConfig.packed_verify (auto: None)")
    parser.add_argument("--exact", action="store_true", help="KernelConfig.exact: the shape-invariant kernels (#29)")
    parser.add_argument("--warm-up", choices=("auto", "on", "off"), default="auto",
                        help="KernelConfig.warm_up: start-up prefill steps that load their kernels (auto: None)")
    parser.add_argument("--random-smollm2", action="store_true",
                        help="without --target: SmolLM2-135M's shape with random weights and the shipped drafter, "
                             "on --prompts (what kernels a real run loads, without its GGUF)")
    parser.add_argument("--prime-allocator-mib", type=int, default=0,
                        help="after each engine's start-up, one block of this size allocated and freed: the caching "
                             "allocator keeps it and splits it for later activations (no cudaMalloc in the passes)")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="after each engine's start-up, gc.freeze() (as `flashtree serve` does): the start-up's "
                             "objects never walked by a full collection inside a pass (passN_gc counts them)")
    parser.add_argument("--profile-batch", type=int, default=0,
                        help="at this batch size, passes 1 and 2 run under torch.profiler: their top ops and kernels "
                             "by self CPU and device time in the JSON (what the first pass does that the second does not)")
    parser.add_argument("--passes", type=int, default=2, help="timed passes per batch size (from the third: "
                        "pass3_tok_s, ...)")
    parser.add_argument("--product-shapes", action="store_true",
                        help="log the eager products' shapes from start-up on (ProductShapes; slows every pass, so "
                             "its tok/s are not comparable with a run without it): pass*_new_product_shapes")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="after the passes, two more over the next batch of prompts (new prompt lengths, so new "
                             "prefill shapes, on the same batch size): fresh1_tok_s, fresh2_tok_s. A per-shape cost "
                             "shows as fresh1 < fresh2; a per-batch-size one as fresh1 == fresh2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.product_shapes:
        global product_shapes
        product_shapes = ProductShapes()
        product_shapes.__enter__()  # (for the whole run: start-up's products count as seen)
    batches = [int(b) for b in args.batches.split(",")]
    packed = {"auto": None, "on": True, "off": False}[args.packed_verify]
    if args.random_smollm2:
        if args.target is not None or args.prompts is None:
            parser.error("--random-smollm2 takes --prompts and no --target")
        target = write_config(Path(tempfile.mkdtemp()) / "target", SMOLLM2_135M)
        drafter = Path(__file__).resolve().parents[1] / "flashtree/assets/smollm2-dflash"
        prompts = [json.loads(line)["prompt_ids"] for line in args.prompts.read_text().splitlines() if line.strip()]
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        shape, model_keywords = "SmolLM2-135M (random bf16) + shipped drafter", dict(random_weights=True)
    elif args.target is None:
        work = Path(tempfile.mkdtemp())
        target = write_config(work / "target", QWEN3_8B)
        drafter = write_config(work / "drafter", QWEN3_8B_DFLASH)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 150000, (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(2 * max(batches))]
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        shape, model_keywords = "qwen3-8b (random bf16)", dict(random_weights=True)
    else:
        if args.drafter is None or args.prompts is None:
            parser.error("--target needs --drafter and --prompts")
        target, drafter = args.target, args.drafter
        lines = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        prompts = [line["prompt_ids"] for line in lines]
        if len(prompts) < max(batches):
            parser.error(f"--prompts {args.prompts} holds {len(prompts)} prompts; --batches needs {max(batches)}")
        params = SamplingParams(max_tokens=args.new_tokens)
        shape, model_keywords = f"{target.name} + {drafter.name} ({args.dtype})", {}
    longest = max(len(p) for p in prompts[:max(batches) * (2 if args.fresh_prompts else 1)])
    warm_up = {"auto": None, "on": True, "off": False}[args.warm_up]
    common = dict(model_keywords, dtype=args.dtype, packed_verify=packed, exact=args.exact, warm_up=warm_up,
                  max_running=max(batches),
                  max_context=longest + args.new_tokens + 64)
    report = {"device": torch.cuda.get_device_name(), "shape": shape,
              "prompt_tokens": [len(p) for p in prompts[:max(batches)]],
              "new_tokens": args.new_tokens, "packed_verify": packed, "exact": args.exact, "warm_up": warm_up, "prime_allocator_mib": args.prime_allocator_mib,
              "freeze_gc": args.freeze_gc, "rows": []}
    plain_tokens = {}
    print(f"{'method':>10} {'batch':>5} {'pass1 tok/s':>12} {'pass2 tok/s':>12} {'1/2':>6} {'captures 1, 2':>14} "
          f"{'start-up s':>10} {'loads 1, 2':>10} {'mallocs 1, 2':>12} equals plain", flush=True)
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        start_captures, start_loads = captures, len(kernel_loads)
        llm = method_engine(method, target, drafter, **common)
        startup = time.perf_counter() - t0
        if args.prime_allocator_mib:
            torch.empty(args.prime_allocator_mib << 20, dtype=torch.uint8, device="cuda")
        if args.freeze_gc:
            gc.collect()
            gc.freeze()
        startup_captures, startup_loads = captures - start_captures, len(kernel_loads) - start_loads
        for batch in batches:
            profiled = batch == args.profile_batch
            first = timed_pass(llm, prompts[:batch], params, profiled)
            second = timed_pass(llm, prompts[:batch], params, profiled)
            later = [timed_pass(llm, prompts[:batch], params) for _ in range(args.passes - 2)]
            row = {"method": method, "batch": batch, "startup_s": startup, "startup_captures": startup_captures,
                   "startup_kernel_loads": startup_loads, "warm_up_s": llm.engine.warm_up_seconds,
                   "pass1_tok_s": first["tok_s"], "pass2_tok_s": second["tok_s"],
                   "pass1_captures": first["captures"], "pass2_captures": second["captures"],
                   "pass1_kernel_loads": len(first["kernel_loads"]), "pass2_kernel_loads": len(second["kernel_loads"]),
                   "pass1_kernels_loaded": first["kernel_loads"], "pass2_kernels_loaded": second["kernel_loads"],
                   "pass1_replay_host_share": first["replay_share"], "pass2_replay_host_share": second["replay_share"],
                   "pass1_allocator": first["allocator"], "pass2_allocator": second["allocator"],
                   "pass1_gc": first["gc"], "pass2_gc": second["gc"],
                   **({"pass1_profile": first["profile"], "pass2_profile": second["profile"]} if profiled else {}),
                   **({"pass1_new_product_shapes": first["new_product_shapes"],
                       "pass2_new_product_shapes": second["new_product_shapes"]} if product_shapes is not None else {}),
                   "same_tokens": all(p["tokens"] == first["tokens"] for p in [second, *later]),
                   **{f"pass{i}_tok_s": p["tok_s"] for i, p in enumerate(later, 3)}}
            if args.fresh_prompts:
                fresh = prompts[batch:2 * batch]
                if len(fresh) < batch:
                    parser.error(f"--fresh-prompts at batch {batch} needs {2 * batch} prompts, got {len(prompts)}")
                for i in (1, 2):
                    fresh_pass = timed_pass(llm, fresh, params)
                    row[f"fresh{i}_tok_s"] = fresh_pass["tok_s"]
                    if product_shapes is not None:
                        row[f"fresh{i}_new_product_shapes"] = fresh_pass["new_product_shapes"]
            if method == "none" and batch not in plain_tokens:  # (a later plain engine is compared with the first)
                plain_tokens[batch] = first["tokens"]
            elif batch in plain_tokens:
                row["equals_plain"] = first["tokens"] == plain_tokens[batch] == second["tokens"]
            if batch > 1 and 1 in plain_tokens:  # batch invariance: the first prompt as it came out alone
                row["first_prompt_equals_plain_batch_1"] = first["tokens"][0] == plain_tokens[1][0]
            report["rows"].append(row)
            print(f"{method:>10} {batch:>5} {first['tok_s']:>12.1f} {second['tok_s']:>12.1f} "
                  f"{first['tok_s'] / second['tok_s']:>6.2f} {first['captures']:>6}, {second['captures']:<6} "
                  f"{startup:>10.1f} {len(first['kernel_loads']):>4}, {len(second['kernel_loads']):<4} "
                  f"{first['allocator']['num_device_alloc']:>5}, {second['allocator']['num_device_alloc']:<5} "
                  f"{row.get('equals_plain', '')}",
                  flush=True)
            Path(args.out).write_text(json.dumps(report, indent=1))  # so far, if a later method runs out of time
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
