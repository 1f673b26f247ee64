"""H200: cost of one decoding round per method at Qwen3-8B shape (random bf16 weights).

    python benchmarks/gpu_rounds.py --out benchmarks/results/gpu_rounds.json

For plain decoding, DFlash (block 16, z-lab Qwen3-8B-DFlash-b16 shape) and DDTree at several
budgets: ms per engine step (= one round for every running row, CUDA graphs on), relative to a
plain decode step, at each batch size; then, with ``profile_stages`` (eager, synchronized), the
split into draft / verify / commit. Random weights make acceptance meaningless here (tau ~ 1):
this measures what a round costs, not how many tokens it yields. Also times the tree-specific
device work alone (build_tree + accept_walk + KV commit) per budget, replayed as a CUDA graph,
and counts host synchronizations during graph-replayed steps.
"""

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config  # noqa: E402
from round_roofline import machine_of, round_floor_ms  # noqa: E402
from tree_build_speed import graphed_ms  # noqa: E402

from flashtree import SamplingParams  # noqa: E402
from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.engine import runner as runner_module  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.engine.graphs import GraphCache  # noqa: E402
from flashtree.kernels.gpu import fused as gpu_fused  # noqa: E402
from flashtree.kernels.gpu import gemm  # noqa: E402
from flashtree.kernels.gpu.attention import AttentionTile  # noqa: E402
from flashtree.kv.cache import KVCache, KVCacheSpec  # noqa: E402
from flashtree.models.transformer import CausalLM  # noqa: E402
from flashtree.speculative.tree import build_tree  # noqa: E402
from flashtree.speculative.verify import accept_walk  # noqa: E402


def start_requests(engine, batch, context):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(0, 150000, (context,), generator=gen).tolist(), params)
            for _ in range(batch)]
    while any(len(r.output_ids) == 0 for r in reqs):
        engine.step()
    return reqs


def time_steps(engine, batch, context, steps, warmup_steps=3, around=None):
    """ms per step (and per stage) of ``steps`` steps of ``batch`` requests after ``warmup_steps``;
    ``around``: a context manager the timed steps run in (e.g. a torch profiler)."""
    reqs = start_requests(engine, batch, context)
    for _ in range(warmup_steps):
        engine.step()
    torch.cuda.synchronize()
    engine.timer.seconds.clear()
    with around if around is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000 / steps
    stages = {k: v * 1000 / steps for k, v in engine.timer.seconds.items()}
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    return ms, stages


def kernel_table(engine, batch, context, top, steps=5):
    """Device time of ``steps`` timed steps (torch.profiler around those steps only: the requests'
    prefill and the warm-up steps stay outside): the summed kernel time and kernel count per step,
    and the ``top`` kernels by device time (name, ms per step, share)."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    wall_ms, _ = time_steps(engine, batch, context, steps, warmup_steps=3, around=profiler)
    events = [e for e in profiler.key_averages() if getattr(e, "device_time_total", 0) > 0]
    total = sum(e.device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return {"wall_ms_per_step_profiled": wall_ms, "device_ms_per_step": total / 1000 / steps,
            "kernels_per_step": sum(e.count for e in events) / steps,
            "top": [{"kernel": e.key[:120], "ms_per_step": e.device_time_total / 1000 / steps,
                     "launches_per_step": e.count / steps, "share": e.device_time_total / total}
                    for e in events[:top]]}


def tree_work_ms(budget, batch, kernel, reps=50):
    """build_tree (``kernel``: its Triton kept-list kernel) + accept_walk + KV commit for one round,
    as one replayed CUDA graph, two ways (ms each):
    - ``graphed``: replayed by the engine's GraphCache, which first copies the drafter logits
      (4.6 MB at budget 256, batch 1) into the graph's input buffer, with the target choices made
      inside the graph from the tree (a roll of its tokens); the figure of earlier sessions;
    - ``static``: the graph reads the logits and a fixed choice tensor where they are, so it holds
      only the tree work (in a round both come from the drafter and verify passes, in the graph).
    Also the eager time (ms)."""
    vocab, depth = QWEN3_8B["vocab_size"], 15
    logits = torch.randn(batch, depth, vocab, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(KVCacheSpec(36, batch, 2048, budget + 1, 8, 128), torch.bfloat16, "cuda")
    slots = torch.arange(batch, device="cuda")
    starts = torch.full((batch,), 1024, device="cuda")
    budgets = torch.full((batch,), budget, device="cuda")

    def build_walk_commit(lg, choice_of):
        tree = build_tree(lg, budgets, budget, kernel=kernel)
        walk = accept_walk(tree, choice_of(tree), depth, kernel=kernel)
        cache.commit(slots, starts, walk.path.clamp(min=0), walk.accept_lengths)
        return walk.accept_lengths

    def rolled(tree):
        return tree.tokens.roll(-1, dims=1)  # any target choices: the walk cost does not depend on them

    def work(lg):
        return build_walk_commit(lg, rolled)

    graphs = GraphCache()
    graphs.run("tree", work, (logits,))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graphs.run("tree", work, (logits,))
    torch.cuda.synchronize()
    graphed = (time.perf_counter() - t0) * 1000 / reps
    fixed_choice = rolled(build_tree(logits, budgets, budget, kernel=kernel))
    static = graphed_ms(lambda: build_walk_commit(logits, lambda _tree: fixed_choice), reps)
    t0 = time.perf_counter()
    for _ in range(10):
        work(logits)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) * 1000 / 10
    return graphed, static, eager


def use_swept_attention_tiles(path: Path) -> None:
    """Launch the tree attention with the best tile ``gpu_tree_attention.py`` found for each (batch, new tokens)
    it measured (the first forward of that size where two share it), the default tile elsewhere."""
    best = {}
    for row in json.loads(path.read_text())["rows"]:
        best.setdefault((row["batch"], row["new_tokens"]), AttentionTile(**row["best"]["tile"]))
    default = gpu_fused.tree_attention  # (the models call the backend module's name)

    def tree_attention(q, *args, **kwargs):
        kwargs.setdefault("tile", best.get((q.shape[0], q.shape[2])))
        return default(q, *args, **kwargs)

    gpu_fused.tree_attention = tree_attention
    print(f"tree attention tiles from {path}: {len(best)} shapes", flush=True)


def count_syncs(engine, batch, context, steps=5):
    """Synchronizing CUDA calls during graph-replayed steps (expected: one per step, the tolist)."""
    reqs = start_requests(engine, batch, context)
    for _ in range(3):
        engine.step()
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            engine.step()
    torch.cuda.set_sync_debug_mode("default")
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    return len([w for w in caught if "synchroniz" in str(w.message)]) / steps


def engine_plan(profile: bool, batches: list[int], per_batch: bool) -> list[tuple[bool, list[int]]]:
    """(profile_stages, the batches it measures) of each engine a method needs: one for every batch when its round
    size comes from a per-batch token bound (a method ddtree:B@N), else one for all."""
    groups = [[batch] for batch in batches] if per_batch else [batches]
    return [(flag, group) for flag in ((False, True) if profile else (False,)) for group in groups]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu_rounds.json")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--methods", default="none,dflash,ddtree:16,ddtree:64,ddtree:256,ddtree:1024",
                        help="comma-separated; empty: only the tree-work timings")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tree-budgets", default="16,64,256,1024")
    parser.add_argument("--triton-tree", action=argparse.BooleanOptionalAction, default=True,
                        help="DDTree kept lists from the Triton kernel (the engine's default)")
    parser.add_argument("--attention", choices=("auto", "triton", "sdpa"), default="auto",
                        help="auto: the engine's default (Triton paged attention for decode rounds, SDPA for "
                             "prefill); triton: Triton for every forward; sdpa: SDPA over gathered pages for every forward")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each method with profile_stages (eager, synchronized) for the stage split")
    parser.add_argument("--exact", action="store_true", help="the exact mode (kernels/gpu/exact.py)")
    parser.add_argument("--exact-tile", default=None, metavar="BM,BN,BK,WARPS,STAGES",
                        help="the exact product's tile for rows past the table's second entry (a tile sweep: every "
                             "tile gives the same bits, gemm.TILES)")
    parser.add_argument("--attention-tiles", type=Path, default=None, metavar="JSON",
                        help="the fast tree attention's launch tile by (batch, new tokens) from a "
                             "gpu_tree_attention.py result (its best tiles; the default tile elsewhere)")
    parser.add_argument("--float-draft-logits", action="store_true",
                        help="the drafter's logits in float32 (before session 30: torch.topk instead of the radix top-k)")
    parser.add_argument("--kernel-table", type=int, default=0, metavar="N",
                        help="also the N kernels of most device time per round (torch.profiler, 5 rounds)")
    parser.add_argument("--packed-verify", choices=("auto", "on", "off"), default="auto",
                        help="KernelConfig.packed_verify (auto: None, padded on CUDA; on: rounds of n nodes per row "
                             "verify rows x (n + 1) tokens packed from trees of up to 4n, --packed-span). A method ddtree:B@N runs "
                             "rounds of N nodes per row (the bound max_round_tokens = batch x (N + 1), one engine a batch) "
                             "with a budget of B: padded, trees of N; packed, trees of min(B, span x N)")
    parser.add_argument("--packed-span", type=int, default=None, metavar="S",
                        help="with --packed-verify on: trees of up to S x N nodes (runner.PACKED_TREE_SPAN)")
    args = parser.parse_args()
    if args.packed_span:
        runner_module.PACKED_TREE_SPAN = args.packed_span
    if args.exact_tile:
        bm, bn, bk, warps, stages = map(int, args.exact_tile.split(","))
        gemm.TILES = (*gemm.TILES[:-1], (gemm.TILES[-1][0], gemm.Tile(bm, bn, bk, warps=warps, stages=stages)))
    if args.attention_tiles:
        use_swept_attention_tiles(args.attention_tiles)
    if args.float_draft_logits:
        CausalLM.draft_head = CausalLM.head
    target = write_config("/tmp/flashtree-qwen3-8b", QWEN3_8B)
    drafter = write_config("/tmp/flashtree-qwen3-8b-dflash", QWEN3_8B_DFLASH)
    rows, batches = [], [int(b) for b in args.batches.split(",")]
    machine = machine_of(torch.cuda.get_device_name())
    packed = {"auto": None, "on": True, "off": False}[args.packed_verify]
    for method in filter(None, args.methods.split(",")):
        name, _, sizes = method.partition(":")
        budget, _, option = sizes.partition("@")
        spec = SpeculationConfig(method=name, draft=None if name == "none" else str(drafter),
                                 budget=int(budget) if budget else None)
        for profile, engine_batches in engine_plan(args.profile, batches, bool(option)):
            engine = LLMEngine(EngineConfig.of(spec=spec, model=str(target), random_weights=True, device="cuda",
                                               max_running=max(engine_batches), max_context=2048, profile_stages=profile,
                                               adaptive_spec=False,  # every round at the method's size
                                               exact=args.exact, packed_verify=packed,
                                               max_round_tokens=engine_batches[0] * (int(option) + 1) if option else None,
                                               triton_tree=args.triton_tree, triton_attention={"auto": None, "triton": True, "sdpa": False}[args.attention]))
            for batch in engine_batches:
                before, replays_before = engine.graph_counts, engine.graph_replays
                ms, stages = time_steps(engine, batch, args.context, args.steps)
                after, replays_after = engine.graph_counts, engine.graph_replays
                row = {"method": method, "batch": batch, "profiled": profile, "ms_per_round": ms, "stages_ms": stages,
                       "graph_captures_and_eager_rounds_while_measured": [a - b for a, b in zip(after, before)]}
                if replays_after[0] > replays_before[0]:  # the host's replay() call per graph (a tenth of the round at most: #39)
                    replays = replays_after[0] - replays_before[0]
                    row["graph_replays_while_measured"] = replays
                    row["host_replay_ms"] = 1e3 * (replays_after[1] - replays_before[1]) / replays
                row["roofline"] = round_floor_ms(method, batch, args.context, QWEN3_8B, QWEN3_8B_DFLASH, machine)
                row["roofline_fraction"] = row["roofline"]["floor_ms"] / ms
                if not profile:
                    row["host_syncs_per_round"] = count_syncs(engine, batch, args.context)
                    if args.kernel_table:
                        row["kernels"] = kernel_table(engine, batch, args.context, args.kernel_table)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del engine
            gc.collect()  # (frees what a reference cycle would keep until the next collection)
            torch.cuda.empty_cache()
    plain = {r["batch"]: r["ms_per_round"] for r in rows if r["method"] == "none" and not r["profiled"]}
    for r in rows:
        r["vs_plain_step"] = r["ms_per_round"] / plain[r["batch"]] if r["batch"] in plain else None
    tree_rows = []
    for budget in [int(b) for b in filter(None, args.tree_budgets.split(","))]:
        for batch in batches:
            graphed, static, eager = tree_work_ms(budget, batch, args.triton_tree)
            tree_rows.append({"budget": budget, "batch": batch, "kernel": args.triton_tree,
                              "graphed_ms": graphed, "static_graph_ms": static, "eager_ms": eager})
            print(json.dumps(tree_rows[-1]), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
           "exact": args.exact, "packed_verify": packed, "roofline_machine": vars(machine), "float_draft_logits": args.float_draft_logits, "exact_tiles": [[limit, tile._asdict()] for limit, tile in gemm.TILES],
           "rounds": rows, "tree_build_accept_commit": tree_rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'method':>12} {'batch':>5} {'prof':>5} {'ms/round':>9} {'x plain':>8} {'floor':>6} {'replay':>7}  stages")
    for r in rows:
        x = f"{r['vs_plain_step']:.2f}" if r["vs_plain_step"] else "-"
        st = " ".join(f"{k}={v:.2f}" for k, v in r["stages_ms"].items())
        replay = f"{r['host_replay_ms']:.3f}" if "host_replay_ms" in r else "-"
        print(f"{r['method']:>12} {r['batch']:>5} {r['profiled']!s:>5} {r['ms_per_round']:9.2f} {x:>8} "
              f"{r['roofline_fraction']:6.0%} {replay:>7}  {st}")
    for t in tree_rows:
        print(f"tree budget {t['budget']:>5} batch {t['batch']}: graphed {t['graphed_ms']:.3f} ms, "
              f"static graph {t['static_graph_ms']:.3f} ms, eager {t['eager_ms']:.2f} ms")


if __name__ == "__main__":
    main()
