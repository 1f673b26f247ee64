"""Tensor parallelism on 1/2/4/8 GPUs (issue #33): a Qwen3-8B and a Qwen3-30B-A3B shape, random bf16 weights.

    python benchmarks/gpu_tp.py --tp 1 --out benchmarks/results/gpu_tp_h200_tp1.json          # one GPU
    python benchmarks/gpu_tp.py --tp 1,2,4,8 --out benchmarks/results/gpu_tp_h100x8.json     # 8 GPUs
    python benchmarks/gpu_tp.py --tiny --tp 1,2 --device cpu --out /tmp/gpu_tp_tiny.json     # CPU dry run (gloo)

For every shape and tensor-parallel size T (1 always runs first, in the same process), at each batch
(default 1, 16, 64 requests of ``--context`` random prompt tokens):

- ``plain``: ms per plain decode step and tokens/s;
- ``ddtree-64``: ms per DDTree round (budget ``--budget``, a random drafter of the z-lab shape), tokens/s
  and tau (random weights: tau stays near 1, so this measures a round's cost, not a real speed-up);
- at T > 1: ``speedup`` (step time at T=1 over T), ``scaling_efficiency`` (tokens/s over T x tokens/s at
  T=1), and ``allreduce_share``: the share of a round's wall time rank 0 spends inside its all-reduces
  and logits gather, from a separate pass that synchronizes the device around each collective (an upper
  bound: it includes waiting for the slowest rank; the timed pass has no such synchronization).

T = 1 is the engine a single GPU runs (no executor, CUDA graphs on); T > 1 runs its rounds eagerly
(CUDA graphs do not capture the workers' commands yet). The TP = 1 cost against the code before tensor
parallelism (the issue's <= 1% target) comes from running this script's ``--tp 1`` against that tree:
``PYTHONPATH=<checkout of 164d528> python benchmarks/gpu_tp.py --tp 1 --out before.json`` (this script
passes no tensor-parallel setting at T = 1, so it runs there too), then ``--compare before.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_moe import QWEN3_30B_A3B
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config

from flashtree import SamplingParams
from flashtree.bench.environment import environment
from flashtree.config import EngineConfig, SpeculationConfig
from flashtree.engine.engine import LLMEngine

QWEN3_30B_A3B_DFLASH = {**QWEN3_8B_DFLASH, "hidden_size": 2048, "intermediate_size": 6144, "num_key_value_heads": 4,
                        "num_target_layers": 48,
                        "dflash_config": {**QWEN3_8B_DFLASH["dflash_config"], "target_layer_ids": [1, 12, 24, 35, 46]}}
SHAPES = {"qwen3-8b": (QWEN3_8B, QWEN3_8B_DFLASH), "qwen3-30b-a3b": (QWEN3_30B_A3B, QWEN3_30B_A3B_DFLASH)}
_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_SHAPES = {
    "tiny-dense": ({**QWEN3_8B, **_TINY}, {**QWEN3_8B_DFLASH, **_TINY, "num_hidden_layers": 1, "num_target_layers": 2,
                                           "dflash_config": {**QWEN3_8B_DFLASH["dflash_config"], "mask_token_id": 7,
                                                             "target_layer_ids": [0, 1]}}),
    "tiny-moe": ({**QWEN3_30B_A3B, **_TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                 {**QWEN3_8B_DFLASH, **_TINY, "num_hidden_layers": 1, "num_target_layers": 2,
                  "dflash_config": {**QWEN3_8B_DFLASH["dflash_config"], "mask_token_id": 7, "target_layer_ids": [0, 1]}}),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(target: Path, drafter: Path | None, budget: int, tp: int, batch: int, context: int,
                device: str) -> LLMEngine:
    spec = SpeculationConfig(method="none") if drafter is None else SpeculationConfig(
        method="ddtree", draft=str(drafter), budget=budget)
    parallel = {} if tp == 1 else {"tensor_parallel_size": tp}  # (T = 1 runs on code without the setting too)
    return LLMEngine(EngineConfig.of(spec=spec, model=str(target), random_weights=True, device=device,
                                     max_running=batch, max_context=context + 512, adaptive_spec=False, **parallel))


def timed_rounds(engine: LLMEngine, batch: int, context: int, steps: int) -> dict:
    """ms per engine step, tokens/s and tau of ``steps`` steps of ``batch`` running requests."""
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps * 20 + 100, ignore_eos=True)
    requests = [engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
                for _ in range(batch)]
    while any(not r.output_ids for r in requests):
        engine.step()
    for _ in range(3):  # (warm-up rounds)
        engine.step()
    synchronize(engine.device)
    before = sum(len(r.output_ids) for r in requests)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in requests) - before
    for r in requests:
        engine.abort(r.request_id)
    engine.step()
    return {"ms_per_step": seconds * 1000 / steps, "tokens_per_s": tokens / seconds, "tau": tokens / (steps * batch)}


@contextlib.contextmanager
def timed_collectives(engine: LLMEngine, device: torch.device):
    """Rank 0's all-reduces and gathers, each synchronized and timed; yields the running total (seconds)."""
    collectives = engine.model.collectives
    total = [0.0]
    originals = {name: getattr(collectives, name) for name in ("all_reduce", "gather")}

    def timed(call):
        def run(*args, **kwargs):
            synchronize(device)
            start = time.perf_counter()
            out = call(*args, **kwargs)
            synchronize(device)
            total[0] += time.perf_counter() - start
            return out
        return run

    for name, call in originals.items():
        setattr(collectives, name, timed(call))
    try:
        yield total
    finally:
        for name, call in originals.items():
            setattr(collectives, name, call)


def allreduce_share(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Share of a synchronized pass's wall time rank 0 spends in its collectives."""
    with timed_collectives(engine, engine.device) as total:
        start = time.perf_counter()
        timed_rounds(engine, batch, context, steps)
        wall = time.perf_counter() - start
    return total[0] / wall


def run_shape(name: str, target: Path, drafter: Path, args) -> list[dict]:
    rows = []
    for tp in args.tp:
        for method, draft in (("plain", None), (f"ddtree-{args.budget}", drafter)):
            engine = make_engine(target, draft, args.budget, tp, max(args.batches), args.context, args.device)
            for batch in args.batches:
                row = {"shape": name, "tp": tp, "method": method, "batch": batch,
                       "cuda_graphs": engine.runner.graphs is not None,
                       **timed_rounds(engine, batch, args.context, args.steps)}
                if tp > 1:
                    row["allreduce_share"] = allreduce_share(engine, batch, args.context, max(3, args.steps // 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
            if getattr(engine, "executor", None) is not None:
                engine.executor.close()
            del engine
            gc.collect()  # (frees what a reference cycle would keep until the next collection)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    add_scaling(rows)
    return rows


def add_scaling(rows: list[dict]) -> None:
    """speedup and scaling efficiency of every T > 1 row against its T = 1 row."""
    one = {(r["shape"], r["method"], r["batch"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        base = one.get((r["shape"], r["method"], r["batch"]))
        if base is not None and r["tp"] > 1:
            r["speedup"] = base["ms_per_step"] / r["ms_per_step"]
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["tp"] * base["tokens_per_s"])


def compare(rows: list[dict], before_path: str) -> list[dict]:
    """T = 1 rows against the same rows of a run on the code before tensor parallelism."""
    before = {(r["shape"], r["method"], r["batch"]): r for r in json.loads(Path(before_path).read_text())["rows"]
              if r["tp"] == 1}
    out = []
    for r in rows:
        old = before.get((r["shape"], r["method"], r["batch"]))
        if r["tp"] == 1 and old is not None:
            out.append({"shape": r["shape"], "method": r["method"], "batch": r["batch"], "ms_now": r["ms_per_step"],
                        "ms_before": old["ms_per_step"], "cost": r["ms_per_step"] / old["ms_per_step"] - 1})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes (1 is always added, first)")
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-30b-a3b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--tiny", action="store_true", help="tiny dense and MoE shapes (a CPU dry run)")
    parser.add_argument("--compare", default=None, metavar="JSON",
                        help="a --tp 1 result of the code before tensor parallelism: report the T = 1 cost against it")
    args = parser.parse_args()
    args.tp = sorted({1, *(int(t) for t in args.tp.split(","))})
    args.batches = [int(b) for b in args.batches.split(",")]
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and max(args.tp) > torch.cuda.device_count():
        parser.error(f"--tp {max(args.tp)} needs {max(args.tp)} GPUs, this machine has {torch.cuda.device_count()}")
    shapes = TINY_SHAPES if args.tiny else {name: SHAPES[name] for name in args.shapes.split(",")}
    root = Path(tempfile.mkdtemp(prefix="flashtree-gpu-tp-"))
    rows = []
    for name, (target_shape, drafter_shape) in shapes.items():
        target = write_config(root / name, target_shape)
        drafter = write_config(root / f"{name}-dflash", drafter_shape)
        rows += run_shape(name, target, drafter, args)
    result = {**environment(torch.device(args.device)), "tp": args.tp, "batches": args.batches,
              "budget": args.budget, "context": args.context, "steps": args.steps, "rows": rows}
    if args.compare:
        result["tp1_against_before"] = compare(rows, args.compare)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'shape':>14} {'tp':>2} {'method':>10} {'batch':>5} {'ms':>8} {'tok/s':>9} {'tau':>5} {'eff':>5} {'AR':>5}")
    for r in rows:
        print(f"{r['shape']:>14} {r['tp']:>2} {r['method']:>10} {r['batch']:>5} {r['ms_per_step']:8.2f} "
              f"{r['tokens_per_s']:9.1f} {r['tau']:5.2f} {r.get('scaling_efficiency', 1.0):5.2f} "
              f"{r.get('allreduce_share', 0.0):5.2f}")
    for c in result.get("tp1_against_before", []):
        print(f"T=1 vs before: {c['shape']} {c['method']} batch {c['batch']}: {100 * c['cost']:+.2f}%")


if __name__ == "__main__":
    main()
