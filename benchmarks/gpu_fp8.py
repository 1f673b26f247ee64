"""H200: FP8 checkpoints (issue #38 part 2) at the Qwen3-8B shape: the plain decode step of a block-FP8 checkpoint
(FP8 products, kernels/gpu/fp8_gemm.py) against the bf16 model's and against the FP8 HBM floor, and FP8 plain vs
FP8 DDTree greedy tokens (the exact mode).

    python benchmarks/gpu_fp8.py --out benchmarks/results/gpu_fp8.json            (about 3-4 minutes)
    python benchmarks/gpu_fp8.py --out ... --sweep      (+ the FP8 product's tile candidates per row count)
    TRITON_INTERPRET=1 python benchmarks/gpu_fp8.py --dry-run --out /tmp/fp8.json  (a tiny shape on the CPU)

1. products: each Qwen3-8B linear (fused q/k/v, o, fused gate/up, down) at M = each batch size, FP8 product vs
   bf16 F.linear, device time per call from CUDA-graph replays over enough weight copies that L2 holds none,
   against its weight bytes / the measured copy bandwidth (``--sweep``: each candidate tile, and whether every
   candidate gives the table tile's bits), and split products ended in their last programs (``fp8_fused_sum_us``,
   gemm.FUSED_SUM) beside the sum kernel;
2. steps: plain decode steps (CUDA graphs, fast mode) at each batch with a ``--context``-token prompt per row,
   random bf16 weights (the config alone) and a random block-FP8 checkpoint written to ``--workdir``
   (e4m3 weights + 128 x 128 weight_scale_inv, bf16 embeddings and LM head, ``quantization_config``); each
   against its floor: (bytes a step reads: every linear's weights and scales, the LM head, the norms, the
   K/V of the context) / bandwidth, with the measured copy bandwidth and the nominal 4.8 TB/s (``--fused-sum-ab``:
   the FP8 steps again with gemm.FUSED_SUM flipped);
3. lossless: FP8 plain vs FP8 DDTree-``--budget`` greedy tokens on ``--prompts`` random prompts in the exact
   mode (bf16 needs it: row-invariant attention and LM head), the target loaded once and shared, the drafter
   the z-lab Qwen3-8B-DFlash shape with random weights (it matches little: the check is that verified trees
   give plain tokens); then the same with random bf16 weights (``lossless_bf16_weights``: the exact mode alone).
The JSON is written after each part.
"""

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config

from flashtree import SamplingParams
from flashtree.config import EngineConfig, SpeculationConfig
from flashtree.engine.engine import LLMEngine
from flashtree.kernels.gpu.fp8_gemm import (
    SCALE_BLOCK,
    TILES,
    Fp8Linear,
    fp8_linear,
    tile_for,
)
from flashtree.kernels.gpu import gemm
from flashtree.kernels.gpu.gemm import Tile
from flashtree.models.build import load_target
from flashtree.models.fp8 import quantize_fp8

NOMINAL_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
L2_FLUSH_BYTES = 256 << 20  # weight copies per product total at least this (H200 L2: 50 MB)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DRY_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "eos_token_id": 1}


# ---------------------------------------------------------------------------- timing

def copy_bandwidth(device: str, n_bytes: int = 2 << 30) -> float:
    """Bytes read + written per second by a device copy (the floor's bandwidth)."""
    if device != "cuda":
        return NOMINAL_BANDWIDTH
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n_bytes * reps / (time.perf_counter() - t0)


def time_calls_us(calls: list, device: str, replays: int = 20) -> float:
    """Microseconds per call of ``calls`` (zero-argument functions), from replays of one CUDA graph of them all
    (no launch overhead; eager on the CPU)."""
    if device != "cuda":
        t0 = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


# ---------------------------------------------------------------------------- 1. products

def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """The decoder layer's products as the model fuses them: name -> (N, K)."""
    hidden, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    return {"qkv": ((heads + 2 * kv) * d, hidden), "o": (hidden, heads * d), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def sweep_tiles(rows: int) -> list[Tile]:
    """Candidate tiles for ``rows`` (block_k is the scale block): the smallest block_m that holds them (16 to
    64), every block_n, warps and pipeline depth whose stages fit in about 200 KB of shared memory."""
    block_m = max(16, min(64, 1 << (rows - 1).bit_length()))
    return [Tile(block_m, block_n, SCALE_BLOCK, warps=warps, stages=stages)
            for block_n in (16, 32, 64, 128) for warps in (2, 4, 8) for stages in (3, 4, 6, 8)
            if not (warps == 8 and block_n < 64) and not (warps == 2 and block_n > 32)
            and (block_m * 2 + block_n) * SCALE_BLOCK * stages <= 200_000]


def product_rows(shape: dict, batches: list[int], bandwidth: float, device: str, dtype: torch.dtype,
                 sweep: bool, sweep_chunks: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (n, k) in linear_shapes(shape).items():
        first = Fp8Linear(*quantize_fp8(torch.randn(n, k, device=device, generator=gen) * 0.02), SCALE_BLOCK, name)
        copies = max(2, math.ceil(L2_FLUSH_BYTES / first.nbytes)) if device == "cuda" else 1
        fp8 = [first] + [Fp8Linear(first.weight.clone(), first.scale.clone(), SCALE_BLOCK, name)
                         for _ in range(copies - 1)]
        dense = [torch.randn(n, k, device=device, generator=gen).to(dtype) * 0.02 for _ in range(copies)]
        for m in batches:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            fp8_us = time_calls_us([lambda w=w, x=x: w(x) for w in fp8], device)
            dense_us = time_calls_us([lambda w=w, x=x: F.linear(x, w) for w in dense], device)
            floor_us = first.nbytes / bandwidth * 1e6
            row = {"product": name, "n": n, "k": k, "m": m, "tile": list(tile_for(m)), "fp8_us": fp8_us,
                   "bf16_us": dense_us, "fp8_floor_us": floor_us, "fp8_fraction_of_floor": floor_us / fp8_us,
                   "bf16_fraction_of_floor": 2 * n * k / bandwidth * 1e6 / dense_us}
            fused = [lambda w=w, x=x: fp8_linear(x, w.weight, w.scale, SCALE_BLOCK, fused_sum=True) for w in fp8]
            row["fp8_fused_sum_us"] = time_calls_us(fused, device)
            row["fused_sum_same_bits"] = torch.equal(fused[0](), first(x))
            if sweep:
                row["sweep"] = sweep_row(fp8, x, m)
            if sweep_chunks:
                row["chunk_sweep"] = chunk_sweep_row(fp8, x)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("sweep", "chunk_sweep")}), flush=True)
        del fp8, dense
    return rows


CHUNK_SWEEP_TILES = (Tile(16, 16, SCALE_BLOCK, warps=2, stages=4), Tile(16, 32, SCALE_BLOCK, warps=4, stages=4),
                     Tile(16, 64, SCALE_BLOCK, warps=4, stages=4), Tile(16, 128, SCALE_BLOCK, warps=8, stages=3))


def chunk_sweep_row(fp8: list[Fp8Linear], x: torch.Tensor) -> list[dict]:
    """How K is cut (``chunk``: every power-of-two multiple of the scale block from 512 up, and all of K) and
    whether the chunks run in programs of their own (``split``), for a few tiles. The cut is a function of the
    weight's shape in the engine (gemm.k_chunk), and it sets the product's bits; the split and the tile do not."""
    k = fp8[0].in_features
    chunks = sorted({c for c in (512 << i for i in range(8)) if c < k} | {k})
    out = []
    for tile in CHUNK_SWEEP_TILES:
        for chunk in chunks:
            for split in ((True, False) if chunk < k else (False,)):
                try:
                    us = time_calls_us([lambda w=w: fp8_linear(x, w.weight, w.scale, SCALE_BLOCK, tile=tile, chunk=chunk,
                                                               split=split) for w in fp8], x.device.type)
                except Exception as err:  # noqa: BLE001 (a tile that does not compile here)
                    out.append({"tile": list(tile), "chunk": chunk, "split": split, "error": str(err)[:200]})
                    continue
                out.append({"tile": list(tile), "chunk": chunk, "split": split, "us": us})
    best = min((r for r in out if "us" in r), key=lambda r: r["us"], default=None)
    print(f"  chunk sweep m={x.shape[0]}: best {best}", flush=True)
    return out


def sweep_row(fp8: list[Fp8Linear], x: torch.Tensor, m: int) -> list[dict]:
    reference = fp8[0](x)
    out = []
    for tile in sweep_tiles(m):
        try:
            same = torch.equal(fp8_linear(x, fp8[0].weight, fp8[0].scale, SCALE_BLOCK, tile=tile), reference)
            us = time_calls_us([lambda w=w, tile=tile: fp8_linear(x, w.weight, w.scale, SCALE_BLOCK, tile=tile)
                                for w in fp8], x.device.type)
        except Exception as err:  # noqa: BLE001 (a tile that does not compile here, e.g. out of shared memory)
            out.append({"tile": list(tile), "error": str(err)[:200]})
            continue
        out.append({"tile": list(tile), "us": us, "same_bits_as_table": same})
    best = min((r for r in out if "us" in r), key=lambda r: r["us"], default=None)
    print(f"  sweep m={m}: best {best}", flush=True)
    return out


# ---------------------------------------------------------------------------- 2. steps

def write_fp8_checkpoint(directory: Path, shape: dict, device: str) -> Path:
    """A random block-FP8 checkpoint of ``shape`` (weights N(0, 0.02) quantized on the device; bf16
    embeddings and LM head, unit norms)."""
    if (directory / "model.safetensors").is_file():
        return directory  # (written by an earlier run: --workdir reused)
    gen = torch.Generator(device=device).manual_seed(1)
    tensors = {}
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    names = {"self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"}, "mlp": {"gate_proj", "up_proj", "down_proj"}}
    shapes = linear_shapes(shape)
    heads_d, kv_d = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    dims = {"q_proj": (heads_d, hidden), "k_proj": (kv_d, hidden), "v_proj": (kv_d, hidden),
            "o_proj": shapes["o"], "gate_proj": (shape["intermediate_size"], hidden),
            "up_proj": (shape["intermediate_size"], hidden), "down_proj": shapes["down"]}
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for module, projections in names.items():
            for projection in sorted(projections):
                values, scale = quantize_fp8(torch.randn(*dims[projection], device=device, generator=gen) * 0.02)
                tensors[f"{prefix}.{module}.{projection}.weight"] = values.cpu()
                tensors[f"{prefix}.{module}.{projection}.weight_scale_inv"] = scale.cpu()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for norm in ("q_norm", "k_norm"):
            tensors[f"{prefix}.self_attn.{norm}.weight"] = torch.ones(shape["head_dim"], dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16).cpu()
    config = {**shape, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [SCALE_BLOCK, SCALE_BLOCK]}}
    write_config(directory, config)
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    return directory


def step_bytes(model, shape: dict, batch: int, context: int) -> int:
    """Bytes a plain decode step reads: every linear's weights (FP8 holders: weights and scales), the LM head,
    the norms and each row's K/V (the embedding: one row per token, left out)."""
    total = 0
    for name, param in model.named_parameters():
        if name != "model.embed_tokens.weight" or model.config.tie_word_embeddings:
            total += param.numel() * param.element_size()
    for layer in model.model.layers:
        for holder in (layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant,
                       layer.mlp.down_quant):
            total += holder.nbytes if isinstance(holder, Fp8Linear) else 0
    kv = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2  # bytes per token
    return total + batch * context * kv


def time_steps(engine: LLMEngine, batch: int, context: int, steps: int, vocab: int) -> float:
    """ms per plain decode step of ``batch`` rows, each with a ``context``-token prompt (after warm-up)."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 20, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(10, vocab, (context,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(len(r.output_ids) == 0 for r in reqs):
        engine.step()
    for _ in range(5):
        engine.step()
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    ms = (time.perf_counter() - t0) * 1000 / steps
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    return ms


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def step_rows(label: str, engine: LLMEngine, shape: dict, args, bandwidth: float) -> list[dict]:
    rows = []
    for batch in args.batch_list:
        ms = time_steps(engine, batch, args.context, args.steps, shape["vocab_size"])
        read = step_bytes(engine.model, shape, batch, args.context)
        rows.append({"weights": label, "batch": batch, "context": args.context, "ms_per_step": ms,
                     "bytes_read": read, "floor_ms": read / bandwidth * 1e3,
                     "fraction_of_floor": read / bandwidth * 1e3 / ms,
                     "floor_ms_nominal": read / NOMINAL_BANDWIDTH * 1e3,
                     "fraction_of_nominal_floor": read / NOMINAL_BANDWIDTH * 1e3 / ms})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------- 3. lossless

def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    return [list(r.output_ids) for r in reqs]


def lossless(target, common: dict, drafter: Path, args, vocab: int) -> dict:
    """FP8 plain vs FP8 DDTree tokens in the exact mode, on the already loaded FP8 ``target`` (switched to the
    exact backend here). The engines' configs say random_weights: the target is given (nothing is read for
    it), and the drafter is drawn from its config."""
    target.model.use_fused_kernels(True, False, attention=None, exact=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, vocab, (int(torch.randint(16, 200, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(args.prompts)]
    out = {}
    for name, spec in (("plain", SpeculationConfig()),
                       (f"ddtree:{args.budget}", SpeculationConfig(method="ddtree", draft=str(drafter),
                                                                   budget=args.budget, adaptive=False))):
        config = EngineConfig.of(spec=spec, **{**common, "random_weights": True, "exact": True,
                                               "max_running": args.prompts})
        engine = LLMEngine(config, target=target)
        t0 = time.perf_counter()
        out[name] = (generate(engine, prompts, args.tokens), time.perf_counter() - t0)
        del engine
    plain_tokens = out["plain"][0]
    tree_tokens = out[f"ddtree:{args.budget}"][0]
    return {"prompts": len(prompts), "tokens_per_prompt": args.tokens, "exact": True,
            "differing_token_lists": sum(a != b for a, b in zip(plain_tokens, tree_tokens)),
            "seconds": {name: seconds for name, (_, seconds) in out.items()}}


# ---------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default=None, help="where the FP8 checkpoint goes (default: a temp dir)")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt in the lossless check")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--parts", default="products,steps,lossless")
    parser.add_argument("--sweep", action="store_true", help="time each candidate tile of the FP8 product")
    parser.add_argument("--sweep-chunks", action="store_true",
                        help="time the product by how K is cut and whether the chunks run apart (chunk_sweep_row)")
    parser.add_argument("--fused-sum-ab", action="store_true",
                        help="steps: also the FP8 steps with split products ended the other way (gemm.FUSED_SUM)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny shape on the CPU (with TRITON_INTERPRET=1)")
    args = parser.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    parts = set(args.parts.split(","))
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    shape = {**QWEN3_8B, **DRY_SHAPE} if args.dry_run else dict(QWEN3_8B)
    if args.dry_run:
        args.context, args.steps, args.tokens = min(args.context, 32), min(args.steps, 3), min(args.tokens, 4)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flashtree-fp8-"))
    bandwidth = copy_bandwidth(device)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "triton": _triton_version(), "shape": shape,
              "copy_bandwidth_bytes_per_s": bandwidth, "nominal_bandwidth_bytes_per_s": NOMINAL_BANDWIDTH,
              "tiles": [[limit, list(tile)] for limit, tile in TILES]}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    if "products" in parts:
        result["products"] = product_rows(shape, args.batch_list, bandwidth, device, dtype, args.sweep,
                                          args.sweep_chunks)
        save()
    common = {"device": device, "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": device == "cuda",
              "max_running": max(args.batch_list), "max_context": max(args.context + args.steps, 256 + args.tokens) + 64,
              "adaptive_spec": False}
    if "steps" in parts:
        engine = LLMEngine(EngineConfig.of(model=str(write_config(workdir / "bf16", shape)), random_weights=True,
                                           **common))
        result["steps"] = step_rows("bf16", engine, shape, args, bandwidth)
        del engine
        _free(device)
        save()
    t0 = time.perf_counter()
    fp8_dir = write_fp8_checkpoint(workdir / "fp8", shape, device)
    result["fp8_checkpoint_write_s"] = time.perf_counter() - t0
    config = EngineConfig.of(model=str(fp8_dir), **common)
    t0 = time.perf_counter()
    target = load_target(config, torch.device(device), dtype)
    result["fp8_load_s"] = time.perf_counter() - t0
    assert isinstance(target.model.model.layers[0].mlp.down_quant, Fp8Linear), "the FP8 products did not switch on"
    if "steps" in parts:
        engine = LLMEngine(config, target=target)
        result["steps"] += step_rows("fp8", engine, shape, args, bandwidth)
        del engine
        if args.fused_sum_ab:  # the same FP8 steps with the other way of ending split products, a new engine's graphs
            gemm.FUSED_SUM = not gemm.FUSED_SUM
            engine = LLMEngine(config, target=target)
            result["steps"] += step_rows(f"fp8_fused_sum_{'on' if gemm.FUSED_SUM else 'off'}", engine, shape, args,
                                         bandwidth)
            gemm.FUSED_SUM = not gemm.FUSED_SUM
            del engine
        by = {(r["weights"], r["batch"]): r["ms_per_step"] for r in result["steps"]}
        result["fp8_over_bf16_step"] = {b: by[("fp8", b)] / by[("bf16", b)] for b in args.batch_list}
        print("fp8 / bf16 step:", json.dumps(result["fp8_over_bf16_step"]), flush=True)
        save()
    if "lossless" in parts:
        drafter = write_config(workdir / "drafter", {**QWEN3_8B_DFLASH, **(
            {**DRY_SHAPE, "num_hidden_layers": 1, "num_target_layers": 2,
             "dflash_config": {**QWEN3_8B_DFLASH["dflash_config"], "mask_token_id": 511, "target_layer_ids": [0, 1]}}
            if args.dry_run else {})})
        result["lossless"] = lossless(target, common, drafter, args, shape["vocab_size"])
        print(json.dumps(result["lossless"]), flush=True)
        save()
        del target
        _free(device)
        # the same check with bf16 weights at the same shape: tells an FP8 product's fault from the exact mode's
        bf16 = load_target(EngineConfig.of(model=str(write_config(workdir / "bf16", shape)), random_weights=True,
                                           **common), torch.device(device), dtype)
        result["lossless_bf16_weights"] = lossless(bf16, common, drafter, args, shape["vocab_size"])
        print("bf16 weights:", json.dumps(result["lossless_bf16_weights"]), flush=True)
        save()
    print(f"wrote {args.out}")


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
