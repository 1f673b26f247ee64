"""H200: where a DDTree round's time goes at Qwen3-8B shape, against the floors of its parts.

    PYTHONPATH=. python benchmarks/gpu_round_anatomy.py [--out FILE]

Writes benchmarks/results/gpu_round_anatomy.json (and .txt) by default (rename them by the device
and the date); the committed run is results/gpu_round_anatomy_h200_2026-12-01.json (and .txt).

Four measurements, each a CUDA-graph replay unless it is a profile:
1. matmul floor: the target's 36 layers of projections (fused qkv, o, fused gate/up, down) and the
   lm_head on ``M`` tokens (M = 1, 17, 65, 257), random bf16 weights, nothing else. This is what a
   verify pass of M - 1 drafted nodes cannot go below at batch 1.
2. attention: 36 layers of SDPA over a 1k context for ``M`` queries, with the additive tree bias
   (what the engine runs; cuDNN picks it) and without a mask (the flash kernel's floor).
3. plain rounds with a drafter loaded: ms per graphed step of a plain engine, a DDTree engine
   pinned to plain rounds (budget 0: no drafter pass, the drafter's context still kept) and
   DDTree-64 under the adaptive policy (a drafter that never matches), sharing the weights,
   interleaved over ``--upkeep-repeats``, at ``--upkeep-batches`` (default 1 and 8). The gaps are
   what a served DDTree pays on every plain round, and what its policy adds.
4. kernel-time tables (torch.profiler, eager) of one DDTree round at budget 256 and of the tree
   work alone (build with the kept-list kernel + walk + commit), to say what to fuse next.
5. ``--upkeep-profile``: where part 3's gap goes. The plain engine and the pinned DDTree engine,
   graphed, under torch.profiler (CPU and CUDA) for 128 steps at each ``--upkeep-batches`` (two
   catch-ups of a 64-token lag inside the window): device kernel time and kernels per step, host
   wall per step, and the kernels and host ops that only the DDTree engine runs.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_rounds import start_requests, time_steps  # noqa: E402
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config  # noqa: E402
from tree_build_speed import graphed_ms  # noqa: E402

from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.kv.cache import KVCache, KVCacheSpec  # noqa: E402
from flashtree.models.attention import attention_bias  # noqa: E402
from flashtree.models.build import load_target, resolve_dtype  # noqa: E402
from flashtree.speculative.tree import build_tree  # noqa: E402
from flashtree.speculative.verify import accept_walk  # noqa: E402


def matmul_floor(tokens_list):
    c = QWEN3_8B
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    qkv_out = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"]
    kw = dict(device="cuda", dtype=torch.bfloat16)
    weights = [(torch.randn(qkv_out, hidden, **kw) * 0.01, torch.randn(hidden, hidden, **kw) * 0.01,
                torch.randn(2 * inter, hidden, **kw) * 0.01, torch.randn(hidden, inter, **kw) * 0.01)
               for _ in range(layers)]
    head = torch.randn(c["vocab_size"], hidden, **kw) * 0.01
    rows = []
    for m in tokens_list:
        x = torch.randn(1, m, hidden, **kw)
        x_inter = torch.randn(1, m, inter, **kw)

        def forward():
            for qkv, o, gate_up, down in weights:
                F.linear(x, qkv)
                F.linear(x, o)
                F.linear(x, gate_up)
                F.linear(x_inter, down)
            F.linear(x[:, -16:], head)  # the verify needs logits at every node; 16 = a chain's worth

        def head_all():
            F.linear(x, head)

        rows.append({"tokens": m, "layers_and_head16_ms": graphed_ms(forward), "head_all_tokens_ms": graphed_ms(head_all)})
        print(json.dumps(rows[-1]), flush=True)
    del weights, head
    torch.cuda.empty_cache()
    return rows


def attention_floor(tokens_list, context=1024):
    c = QWEN3_8B
    kw = dict(device="cuda", dtype=torch.bfloat16)
    rows = []
    for m in tokens_list:
        q = torch.randn(1, c["num_attention_heads"], m, c["head_dim"], **kw)
        k = torch.randn(1, c["num_key_value_heads"], context + m, c["head_dim"], **kw)
        v = torch.randn_like(k)
        mask = torch.ones(1, 1, m, context + m, dtype=torch.bool, device="cuda")
        mask[..., context:] = torch.ones(m, m, dtype=torch.bool, device="cuda").tril()
        bias = attention_bias(mask, torch.bfloat16)

        def masked():
            for _ in range(c["num_hidden_layers"]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

        def unmasked():
            for _ in range(c["num_hidden_layers"]):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        rows.append({"queries": m, "context": context, "bias_36_layers_ms": graphed_ms(masked),
                     "no_mask_36_layers_ms": graphed_ms(unmasked)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


UPKEEP_ENGINES = {  # name -> (method, budget, adaptive policy)
    "plain": ("none", None, False),
    "ddtree pinned to plain rounds": ("ddtree", 0, False),
    "ddtree-64 adaptive": ("ddtree", 64, True),
}


def plain_round_upkeep(target, drafter, batches, repeats=1, context=1024, steps=30, warmup_steps=150,
                       device="cuda"):
    """ms per step of the UPKEEP_ENGINES, sharing the target's weights, interleaved over ``repeats``
    (drift hits all alike): a plain engine; a DDTree engine pinned to plain rounds (budget 0: no
    drafter pass, the drafter's context still kept); and DDTree-64 under the adaptive policy, as a
    server runs it (its random drafter never matches: after exploring, plain rounds and rare
    probes). Pinned minus plain is the device and host upkeep of a loaded drafter; adaptive minus
    pinned is the policy's (host work, probes). The adaptive engine explores each batch's bucket
    first, in ``warmup_steps`` unmeasured steps."""
    loaded = load_target(EngineConfig.of(model=str(target), random_weights=True, device=device),
                         torch.device(device), resolve_dtype("auto", torch.device(device)))
    engines = {}
    for name, (method, budget, adaptive) in UPKEEP_ENGINES.items():
        spec = SpeculationConfig(method=method, draft=None if method == "none" else str(drafter), budget=budget)
        config = EngineConfig.of(spec=spec, model=str(target), random_weights=True, device=device,
                                 max_running=max(batches), max_context=context + 1024, adaptive_spec=adaptive)
        engines[name] = LLMEngine(config, target=loaded)
    for batch in batches:
        time_steps(engines["ddtree-64 adaptive"], batch, context, warmup_steps)
    rows = []
    for repeat in range(repeats):
        for batch in batches:
            for name, engine in engines.items():
                ms, _ = time_steps(engine, batch, context, steps)
                rows.append({"engine": name, "batch": batch, "repeat": repeat, "ms_per_step": ms,
                             "rounds_by_nodes": dict(engine.rounds_by_nodes)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def profiled_steps(engine, batch, context, steps=128, warmup_steps=70):
    """Device kernel time, kernel count and host wall per step of ``steps`` profiled steps, and
    the per-step time of every kernel and host op by name."""
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    wall_ms, _ = time_steps(engine, batch, context, steps, warmup_steps=warmup_steps, around=prof)
    kernels, host = {}, {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0 and e.device_type is not None and "cuda" in str(e.device_type).lower():
            kernels[e.key] = (e.self_device_time_total / steps, e.count / steps)
        elif e.self_cpu_time_total > 0:
            host[e.key] = (e.self_cpu_time_total / steps, e.count / steps)
    device_us = sum(us for us, _ in kernels.values())
    return {"wall_ms": round(wall_ms, 4), "device_us_per_step": round(device_us, 2),
            "kernels_per_step": round(sum(n for _, n in kernels.values()), 2), "kernels": kernels, "host": host}


def upkeep_profile(target, drafter, batches, context=1024, device="cuda"):
    """Part 5: profiled plain engine against the pinned DDTree engine; lists what differs."""
    loaded = load_target(EngineConfig.of(model=str(target), random_weights=True, device=device),
                         torch.device(device), resolve_dtype("auto", torch.device(device)))
    rows, text = [], []
    for name in ("plain", "ddtree pinned to plain rounds"):
        method, budget, adaptive = UPKEEP_ENGINES[name]
        spec = SpeculationConfig(method=method, draft=None if method == "none" else str(drafter), budget=budget)
        config = EngineConfig.of(spec=spec, model=str(target), random_weights=True, device=device,
                                 max_running=max(batches), max_context=context + 1024, adaptive_spec=adaptive)
        engine = LLMEngine(config, target=loaded)
        for batch in batches:
            rows.append({"engine": name, "batch": batch} | profiled_steps(engine, batch, context))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("kernels", "host")}), flush=True)
        del engine
    for batch in batches:
        plain, pinned = (r for r in rows if r["batch"] == batch)
        for part in ("kernels", "host"):
            extra = sorted(((us - plain[part].get(key, (0.0, 0.0))[0], n - plain[part].get(key, (0.0, 0.0))[1], key)
                            for key, (us, n) in pinned[part].items()), reverse=True)[:25]
            text.append(f"=== batch {batch}: {part} the pinned DDTree engine spends more on (us, calls per step) ===")
            text += [f"{us:9.2f} {n:7.2f}  {key[:90]}" for us, n, key in extra]
    return rows, "\n".join(text)


def kernel_table(prof, n):
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=70)


def profile_round(target, drafter, budget, context=1024):
    spec = SpeculationConfig(method="ddtree", draft=str(drafter), budget=budget)
    engine = LLMEngine(EngineConfig.of(spec=spec, model=str(target), random_weights=True, device="cuda",
                                       max_running=1, max_context=2048, adaptive_spec=False, cuda_graphs=False))
    start_requests(engine, 1, context)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    text = f"=== DDTree-{budget} round, batch 1, 5 rounds (eager) ===\n" + kernel_table(prof, 40)
    del engine
    torch.cuda.empty_cache()
    return text


def profile_tree_work(budget, batch=1):
    vocab, depth = QWEN3_8B["vocab_size"], 15
    logits = torch.randn(batch, depth, vocab, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(KVCacheSpec(36, batch, 2048, budget + 1, 8, 128), torch.bfloat16, "cuda")
    slots, starts = torch.arange(batch, device="cuda"), torch.full((batch,), 1024, device="cuda")
    budgets = torch.full((batch,), budget, device="cuda")

    def work():
        tree = build_tree(logits, budgets, budget, kernel=True)
        walk = accept_walk(tree, tree.tokens.roll(-1, 1), depth, kernel=True)
        cache.commit(slots, starts, walk.path.clamp(min=0), walk.accept_lengths)

    for _ in range(2):
        work()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            work()
        torch.cuda.synchronize()
    return f"=== tree work (kernel), budget {budget}, batch {batch}, 5 rounds ===\n" + kernel_table(prof, 40)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu_round_anatomy.json")
    parser.add_argument("--tokens", default="1,17,65,257")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: matmul,attention,upkeep,profile")
    parser.add_argument("--upkeep-batches", default="1,8", help="batches of the plain-round upkeep part")
    parser.add_argument("--upkeep-repeats", type=int, default=1, help="interleaved repeats of the upkeep part")
    parser.add_argument("--upkeep-profile", action="store_true", help="part 5: profile the upkeep part's gap")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tokens = [int(t) for t in args.tokens.split(",")]
    target = write_config("/tmp/flashtree-qwen3-8b", QWEN3_8B)
    drafter = write_config("/tmp/flashtree-qwen3-8b-dflash", QWEN3_8B_DFLASH)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "matmul" not in skip:
        out["matmul_floor"] = matmul_floor(tokens)
    if "attention" not in skip:
        out["attention"] = attention_floor(tokens)
    if "upkeep" not in skip:
        out["plain_round_upkeep"] = plain_round_upkeep(target, drafter, [int(b) for b in args.upkeep_batches.split(",")],
                                                       repeats=args.upkeep_repeats)
    if args.upkeep_profile:
        out["upkeep_profile"], table = upkeep_profile(target, drafter, [int(b) for b in args.upkeep_batches.split(",")])
        Path(args.out).with_suffix(".upkeep.txt").write_text(table)
        print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if "profile" not in skip:
        tables = [profile_tree_work(256), profile_round(target, drafter, 256)]
        Path(args.out).with_suffix(".txt").write_text("\n\n".join(tables))
        print("\n\n".join(tables))


if __name__ == "__main__":
    main()
