"""H200: a Qwen3-MoE target (the Qwen3-30B-A3B shape, random bf16 weights) against the bytes it must read.

    python benchmarks/gpu_moe.py --out benchmarks/results/gpu_moe_h200.json
    python benchmarks/gpu_moe.py --tiny --out /tmp/gpu_moe_tiny.json   # a tiny config; runs on a CPU too

1. The plain decode step at batch 1 (the engine, CUDA graphs on where the MoE routes on the device),
   against the floor of its active parameters: the dense part (attention, norms, routers, lm_head;
   the embedding is one row) plus ``num_experts_per_tok`` experts per layer, read once at
   ``--bandwidth`` (4.2 TB/s).
2. One row's forward of N = 1, 4, 16, 64, 256 new tokens (a chain's verification at ``--context``
   committed tokens, logits at every token), replayed as a CUDA graph: the experts each MoE layer
   touches (read off the routing of that forward), the time, the floor (the dense part plus every
   touched expert, each read once) and time / floor. ``--reference`` also times the host-routed
   reference path (experts one after another, eager) at each N, the path the fused kernels replace.
3. The first MoE layer's fused call alone at each N (graph-replayed) against its floor (the router
   and the touched experts), with each kernel's device time (torch.profiler); ``--sweep`` also
   times it by the grouped products' tiles.

Random weights route near-uniformly, so N tokens touch about as many experts as they can: a real
model's routing is more skewed (fewer experts, a lower floor).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import write_config

from flashtree import SamplingParams
from flashtree.bench.environment import environment
from flashtree.config import EngineConfig
from flashtree.engine.engine import LLMEngine
from flashtree.kernels.gpu import moe as moe_kernels
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.moe import SparseMoE, routes_on_host

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "eos_token_id": 151645,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32)


def sparse_layers(model) -> list[SparseMoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


def parameter_bytes(model) -> tuple[int, int]:
    """(bytes of the dense part a forward reads, bytes of one expert): the embedding is left out
    (a forward reads one row a token) unless the lm_head shares it."""
    dense = experts = 0
    for name, param in model.named_parameters():  # (a tied lm_head is listed once, as the embedding)
        size = param.numel() * param.element_size()
        if ".experts." in name:
            experts += size
        elif "embed_tokens" not in name or model.config.tie_word_embeddings:
            dense += size
    moe = model.config.moe
    return dense, experts // (len(sparse_layers(model)) * moe.num_experts)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_step_ms(engine: LLMEngine, context: int, steps: int) -> float:
    """ms per plain engine step of one request after a ``context``-token prompt."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    request = engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(),
                                 SamplingParams(max_tokens=steps + 50, ignore_eos=True))
    while not request.output_ids:
        engine.step()
    for _ in range(5):
        engine.step()
    synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.device)
    ms = (time.perf_counter() - start) * 1000 / steps
    engine.abort(request.request_id)
    engine.step()
    return ms


def chain_batch(n: int, context: int, vocab: int, device: torch.device, seed: int) -> ForwardBatch:
    """One row (slot 0) of n new causal tokens after ``context`` committed ones."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
    return ForwardBatch(ids, (context + torch.arange(n))[None].to(device), torch.zeros(1, dtype=torch.long, device=device),
                        torch.full((1,), context, device=device), causal_mask(torch.tensor([n]), n).to(device),
                        kv_len=context + n)


def touched_experts(model, batch: ForwardBatch, cache: KVCache) -> list[int]:
    """Distinct experts each MoE layer routes this forward's tokens to (an eager forward)."""
    touched = []

    def count(module, args):
        _, ids = module.route(args[0].reshape(-1, args[0].shape[-1]))
        touched.append(int(ids.unique().numel()))

    hooks = [moe.register_forward_pre_hook(count) for moe in sparse_layers(model)]
    stack, model.layer_stack = getattr(model, "layer_stack", None), None  # (the CPU's one-call layer stack runs
    try:                                                                   # the layers without their hooks)
        model(batch, cache)
    finally:
        model.layer_stack = stack
        for hook in hooks:
            hook.remove()
    return touched


def timed_ms(fn, reps: int, graphed: bool, device: torch.device) -> float:
    """ms per call of ``fn()``: replays of it captured as one CUDA graph (``graphed``), else eager calls."""
    if graphed:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1000 / reps


def kernel_us(fn, reps: int) -> dict[str, float]:
    """Device microseconds per call of ``fn()`` by kernel name (torch.profiler, eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            times[event.key[:60]] = event.self_device_time_total / reps
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def select_us_by_warps(fn, reps: int, choices: list[int]) -> dict[int, float]:
    """The selection kernel's device us per call of ``fn()`` at each of ``choices`` warps."""
    if not choices:
        return {}
    default = moe_kernels.SELECT_WARPS
    times = {}
    try:
        for warps in choices:
            moe_kernels.SELECT_WARPS = warps
            times[warps] = kernel_us(fn, reps).get("_select_experts_kernel")
    finally:
        moe_kernels.SELECT_WARPS = default
    return times


def layer_rows(model, tokens: list[int], reps: int, bandwidth: float, expert: int, sweep: bool,
               select_warps: list[int]) -> list[dict]:
    """The first MoE layer's fused call alone on N random tokens, graph-replayed: the experts its
    routing touches, ms, the floor (router + touched experts) and, with ``sweep``, ms by the tiles of
    each grouped product (the other at its default)."""
    moe = sparse_layers(model)[0]
    device, dtype = moe.gate.weight.device, moe.gate.weight.dtype
    router = moe.gate.weight.numel() * moe.gate.weight.element_size()
    defaults = moe_kernels.GATE_UP_TILES, moe_kernels.DOWN_TILES
    choices = [moe_kernels.Tiles(n, 4, stages) for n in (32, 64, 128) for stages in (3, 4, 5)] if sweep else []
    rows = []
    for n in tokens:
        x = torch.randn(n, moe.gate.weight.shape[1], device=device, dtype=dtype)
        _, ids, _ = moe_kernels.route(x, moe.gate.weight, moe.top_k, moe.normalize)
        touched = int(ids.unique().numel())
        graphed = device.type == "cuda"
        row = {"tokens": n, "experts_touched": touched, "floor_ms": (router + touched * expert) / bandwidth * 1000,
               "ms": timed_ms(lambda: moe(x), reps, graphed, device)}  # noqa: B023 (timed at once)
        row["time_over_floor"] = row["ms"] / row["floor_ms"]
        if graphed:
            try:
                row["kernels_us"] = kernel_us(lambda: moe(x), reps)  # noqa: B023
                row["select_us_by_warps"] = select_us_by_warps(lambda: moe(x), reps, select_warps)  # noqa: B023
            except Exception as err:  # noqa: BLE001 (a profiler that cannot read the device: the rest still runs)
                row["kernels_us"] = {"error": repr(err)}
        for name, index in (("gate_up", 0), ("down", 1)):
            for tiles in choices:
                picked = list(defaults)
                picked[index] = tiles
                moe_kernels.GATE_UP_TILES, moe_kernels.DOWN_TILES = picked
                row[f"{name}_{tiles.block_n}x{tiles.warps}w{tiles.stages}s_ms"] = timed_ms(
                    lambda: moe(x), reps, graphed, device)  # noqa: B023
            moe_kernels.GATE_UP_TILES, moe_kernels.DOWN_TILES = defaults
        rows.append(row)
        print(json.dumps({"layer": row}), flush=True)
    return rows


def reference_path(model, on: bool) -> None:
    """Switch the MoE layers alone to the host-routed reference path (``on``) or back to the model's kernels."""
    for moe in sparse_layers(model):
        moe.kernels = None if on else model.kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 8-expert config (a CPU dry run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s of the floor")
    parser.add_argument("--reference", action="store_true", help="also time the host-routed reference path")
    parser.add_argument("--sweep", action="store_true", help="time one MoE layer by the grouped products' tiles")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the shape's; fewer fit a smaller GPU, per-layer figures alike)")
    parser.add_argument("--select-warps", default="1,2,4", help="warps of the selection kernel to time per N")
    parser.add_argument("--forward-kernels", default="1",
                        help="N values whose whole forward gets a kernel table (device us per forward by kernel, "
                             "eager calls; their sum against the graphed ms is the share of gaps); '' for none")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = TINY if args.tiny else QWEN3_30B_A3B
    if args.layers:
        shape = dict(shape, num_hidden_layers=args.layers)
    tokens = [int(n) for n in args.tokens.split(",")]
    model_dir = write_config(Path(tempfile.mkdtemp()) / "qwen3-moe", shape)
    engine = LLMEngine(EngineConfig.of(model=str(model_dir), random_weights=True, max_running=1,
                                       max_context=args.context + max(tokens) + 64, device=str(device)))
    model = engine.model
    graphed = engine.runner.graphs is not None
    dense, expert = parameter_bytes(model)
    layers, top_k = len(sparse_layers(model)), shape["num_experts_per_tok"]
    active = dense + layers * top_k * expert
    step_ms = decode_step_ms(engine, args.context, args.steps)
    decode = {"ms_per_step": step_ms, "active_bytes": active, "floor_ms": active / args.bandwidth * 1000,
              "cuda_graphs": graphed, "routes_on_host": routes_on_host(model)}
    decode["time_over_floor"] = step_ms / decode["floor_ms"]
    print(json.dumps({"decode": decode}), flush=True)
    cfg = model.config
    cache = KVCache(KVCacheSpec(cfg.num_hidden_layers, 1, args.context, max(tokens), cfg.num_key_value_heads,
                                cfg.head_dim), model.lm_head.weight.dtype, device)
    rows = []
    for n in tokens:
        batch = chain_batch(n, args.context, cfg.vocab_size, device, seed=n)
        touched = touched_experts(model, batch, cache)
        floor_bytes = dense + sum(touched) * expert
        ms = timed_ms(lambda: model(batch, cache), args.reps, graphed and device.type == "cuda", device)  # noqa: B023
        row = {"tokens": n, "experts_touched_mean": sum(touched) / len(touched), "experts_touched_min": min(touched),
               "experts_touched_max": max(touched), "ms": ms, "floor_bytes": floor_bytes,
               "floor_ms": floor_bytes / args.bandwidth * 1000, "graphed": graphed and device.type == "cuda"}
        row["time_over_floor"] = ms / row["floor_ms"]
        if row["graphed"] and str(n) in args.forward_kernels.split(","):
            row["kernels_us"] = kernel_us(lambda: model(batch, cache), args.reps)  # noqa: B023
            row["kernels_busy_ms"] = sum(row["kernels_us"].values()) / 1000
        if args.reference:
            reference_path(model, True)
            row["reference_eager_ms"] = timed_ms(lambda: model(batch, cache), max(1, args.reps // 5), False,  # noqa: B023
                                                 device)
            reference_path(model, False)
        rows.append(row)
        print(json.dumps(row), flush=True)
    layer = []
    if sparse_layers(model)[0].routes_on_device:  # (the fused kernels: CUDA, or Triton's interpreter)
        layer = layer_rows(model, tokens, args.reps, args.bandwidth, expert, args.sweep,
                           [int(w) for w in args.select_warps.split(",") if w])
    result = {**environment(device), "shape": "tiny" if args.tiny else "qwen3-30b-a3b", "config": shape,
              "dtype": str(model.lm_head.weight.dtype), "bandwidth": args.bandwidth, "context": args.context,
              "dense_bytes": dense, "expert_bytes": expert, "decode": decode, "forwards": rows,
              "moe_layer": layer, "tiles": {"gate_up": moe_kernels.GATE_UP_TILES._asdict(),
                                            "down": moe_kernels.DOWN_TILES._asdict()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'N':>4} {'experts':>7} {'ms':>8} {'floor':>7} {'x floor':>7}")
    for r in rows:
        print(f"{r['tokens']:>4} {r['experts_touched_mean']:7.1f} {r['ms']:8.3f} {r['floor_ms']:7.3f} "
              f"{r['time_over_floor']:7.2f}")


if __name__ == "__main__":
    main()
