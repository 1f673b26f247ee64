"""H200: how many concurrent 1k-token requests the paged KV pool admits at the Qwen3-8B shape.

Random bf16 weights, ``--max-context`` 32k, the pool sized by ``--gpu-memory-utilization``, plain
and DDTree (the z-lab Qwen3-8B-DFlash-b16 shape's drafter shares the pages). Submits more
``--prompt-tokens`` requests (``--max-tokens`` each) than fit, steps the engine a few times, and
reports the pool's pages, the requests it promised pages to (running) and what the arithmetic says
fits, and the KV bytes in use against the bytes of the tokens held (target entries).

    python benchmarks/gpu_kv_capacity.py --out benchmarks/results/gpu_kv_capacity_h200.json
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config  # noqa: E402

from flashtree import SamplingParams  # noqa: E402
from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402


def measure(spec: SpeculationConfig, args, adaptive: bool = False) -> dict:
    target = write_config("/tmp/flashtree-qwen3-8b", {**QWEN3_8B, **json.loads(args.shape_override)})
    engine = LLMEngine(EngineConfig.of(spec=spec, model=str(target), random_weights=True, device=args.device,
                                       max_running=args.max_running, max_context=args.max_context,
                                       gpu_memory_utilization=args.gpu_memory_utilization, adaptive_spec=adaptive,
                                       max_waiting=4 * args.max_running, prefill_chunk=args.prompt_tokens,
                                       max_prefill_tokens=16 * args.prompt_tokens,
                                       max_round_tokens=args.max_round_tokens))
    cfg = engine.model.config
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(args.max_running):
        engine.add_request(torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist(), params)
    for _ in range(args.steps):
        engine.step()
    running = [r for r in engine.scheduler.active if not r.finished]
    pool, budget = engine.pages.pool, engine.scheduler.pages
    entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    held = sum(r.committed_length if r.output_ids else r.prefilled for r in running)
    page_bytes = (entry + engine.proposer.context_entry_bytes()) * engine.pages.page_size
    row = {"method": spec.method, "adaptive": adaptive, "budget": spec.budget, "max_round_tokens": args.max_round_tokens,
           "pool_pages": pool.capacity,
           "page_size": engine.pages.page_size,
           "pool_gib": pool.num_pages * page_bytes / 2**30, "pages_per_request": budget.need(running[0], args.max_context),
           "fits_by_arithmetic": budget.capacity // budget.need(running[0], args.max_context),
           "running": len(running), "waiting": len(engine.scheduler.waiting),
           "kv_bytes_in_use": pool.used_pages * page_bytes, "token_bytes_held": held * (entry + engine.proposer.context_entry_bytes()),
           "one_page_per_request_bytes": len(running) * page_bytes,
           "activation_reserve_gib": {k: round(v / 2**30, 2) for k, v in engine.activation_reserve._asdict().items()},
           **_device_memory(args)}
    print(json.dumps(row), flush=True)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def _device_memory(args) -> dict:
    """The device's memory in use after the steps (any process), against the fraction the pool was sized for,
    and the allocator's peak reservation: start-up's graph captures and the steps' activations included."""
    if args.device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"device_used_fraction": round((total - free) / total, 4),
            "allocator_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "allocator_gib_by_pool": _segments_by_pool()}


def _segments_by_pool() -> dict:
    """The allocator's reserved and allocated GiB by pool: each CUDA graphs' private pool, and the streams'."""
    reserved, allocated = defaultdict(int), defaultdict(int)
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        name = f"graphs {pool}" if pool != (0, 0) else f"stream {segment['stream']}"
        reserved[name] += segment["total_size"]
        allocated[name] += sum(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
    return {name: {"reserved": round(reserved[name] / 2**30, 2), "allocated": round(allocated[name] / 2**30, 2)}
            for name in reserved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-running", type=int, default=1024)
    parser.add_argument("--methods", default="none,ddtree", help="none, ddtree (DDTree-16, fixed), adaptive (DDTree-64, adaptive)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-round-tokens", type=int, default=None,
                        help="the scheduler's bound on a round's verified tokens (None: none for the fixed budget)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape-override", default="{}",
                        help='JSON keys over both configs (a CPU dry run: \'{"hidden_size": 64, ...}\')')
    args = parser.parse_args()
    drafter = write_config("/tmp/flashtree-qwen3-8b-dflash", {**QWEN3_8B_DFLASH, **json.loads(args.shape_override)})
    specs = {"none": SpeculationConfig(method="none"),
             "ddtree": SpeculationConfig(method="ddtree", draft=str(drafter), budget=16)}
    specs["adaptive"] = SpeculationConfig(method="ddtree", draft=str(drafter), budget=64)  # the served default
    rows = [measure(specs[method], args, adaptive=method == "adaptive") for method in args.methods.split(",")]
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out = {"device": device, "args": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
