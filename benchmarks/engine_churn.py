"""The paired load test's workload without the server: plain, DDTree-64 and DFlash engines (adaptive
speculation, as served) sharing one target's weights, each keeping C requests in flight (a finished
request is replaced at once, prompts of 20-60 tokens, 128 new tokens, end of sequence ignored),
interleaved level by level and repeat by repeat in rotating order.

Why: served at one row on the H200, the speculative servers' plain rounds took 0.05-0.2 ms (1-4%)
longer than the plain server's (benchmarks/journal/session-11-2026-12-02.md), while an engine-level
run with rows starting together showed no such cost. This run has the server's churn but no HTTP,
event loop or second thread: a gap here lies in the engine; no gap here puts it in the server.

``--interleave step`` runs the engines' passes at once, one step each in turn: each engine's
tokens/s then counts only its own steps' wall time, and a drift of the machine's speed over a
pass falls on all engines alike (whole passes in rotating order, the default, are what the
paired load test does). Each pass also reports its step time by kind: plain rounds, tree rounds,
plain rounds with a drafter catch-up, and steps with a prefill. Each step is synchronized, so
an engine that queues its next plain round before reading the current one (engine/overlap.py,
on by default on CUDA) gains nothing from it there: ``--interleave block`` runs
``--block-steps`` steps of one engine, synchronizes and bills their wall time to it, then the
next engine's, so queued rounds overlap the host's work within a block while the engines still
share the machine's drift. ``--unqueued`` adds a plain engine that does not queue its rounds
(``none-unqueued``), to show what queueing gives; ``--without-sink`` a DDTree engine that keeps the
drafter's features as before session 15 (``ddtree-no-sink``, ``feature_sink=False``: concatenation +
``defer``);
``--doubling-probes`` a DDTree engine whose probes back off by doubling alone, as before session 17
(``ddtree-doubling-probes``: no ``probe_cost_share`` floor); ``--twin`` a second plain engine like the
first (``none-twin``): the engines share the target's weights, so the twins' spread is what two
engines doing the same work differ by (their KV caches, graph pools and objects), the yardstick for
the speculative engines' gaps at a row (1% both ways in the fifteenth to eighteenth sessions).

    PYTHONPATH=. python benchmarks/engine_churn.py --shape qwen3-8b [--levels 1,4,16,32] [--repeats 3]
        [--interleave pass|step|block] [--block-steps 32] [--unqueued] [--twin] [--out FILE]
    python benchmarks/engine_churn.py --summarize FILE      (the tables of an earlier run)
    python benchmarks/engine_churn.py --model smollm2 --levels 1,4 --repeats 2 --requests 4     (CPU: the shipped pair)

``--shape qwen3-8b``: random bf16 weights at Qwen3-8B shape with SmolLM2's 49,152-token vocabulary
and a random z-lab Qwen3-8B-DFlash-b16 drafter, as ``gpu_load.sh`` serves them. Prompts are random
token ids, so with a real pair (the CPU line) the acceptance says nothing about real text: the run
compares engines on one workload, it does not measure a speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flashtree, without PYTHONPATH (the device has no install)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import write_served_pair  # noqa: E402

from flashtree.config import EngineConfig, PolicyConfig, SpeculationConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.engine.request import Status  # noqa: E402
from flashtree.models.build import load_target, resolve_dtype  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402
from flashtree.speculative.defaults import shipped_drafter  # noqa: E402

METHODS = {"none": None, "ddtree": 64, "dflash": None}  # method -> budget (as gpu_load.sh serves them)
NEW_TOKENS = 128


def make_engines(model: str, draft: str | None, random_weights: bool, device: str, max_running: int,
                 trace_dir: Path | None = None, unqueued: bool = False, without_sink: bool = False,
                 doubling_probes: bool = False, twin: bool = False) -> dict:
    dev = torch.device(device)
    base = EngineConfig.of(model=model, random_weights=random_weights, device=device)
    loaded = load_target(base, dev, resolve_dtype("auto", dev))
    engines = {}
    variants = [(m, m, None) for m in METHODS] + ([("none-unqueued", "none", False)] if unqueued else [])
    variants += [("ddtree-no-sink", "ddtree", None)] if without_sink else []
    variants += [("ddtree-doubling-probes", "ddtree", None)] if doubling_probes else []
    variants += [("none-twin", "none", None)] if twin else []
    for name, method, queue in variants:
        spec = SpeculationConfig(method=method, draft=None if method == "none" else draft, budget=METHODS[method])
        trace = str(trace_dir / f"steps_{name}.jsonl") if trace_dir else None
        # feature_sink off (ddtree-no-sink): plain rounds return the captured features (a
        # concatenation) and defer them (a scatter), as before session 15
        config = EngineConfig.of(spec=spec, model=model, random_weights=random_weights, device=device,
                                 max_running=max_running, max_context=1024, adaptive_spec=True, trace_steps=trace,
                                 queue_plain_rounds=queue, spec_policy=policy_config(name),
                                 feature_sink=not name.endswith("no-sink"))
        engines[name] = LLMEngine(config, target=loaded)
    return engines


def policy_config(name: str) -> PolicyConfig:
    """The speculation policy's knobs of an engine variant: ``ddtree-doubling-probes`` backs off
    its probes by doubling alone, as before session 17 (no ``probe_cost_share`` floor)."""
    default = PolicyConfig()
    return dataclasses.replace(default, probe_cost_share=None) if name.endswith("doubling-probes") else default


def workload(concurrency: int, requests: int, vocab: int, seed: int) -> list[list[int]]:
    """The prompts of one pass: the same for every engine (token ids 3 .. 499, 20-60 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, min(500, vocab)) for _ in range(rng.randrange(20, 61))] for _ in range(requests)]


class ClosedLoop:
    """One engine's closed loop over a pass's prompts: ``concurrency`` requests in flight, a
    finished one replaced at once. ``step()`` runs one engine step and files its wall time
    (device work included) under what the step did."""

    KINDS = ("plain", "tree", "catch_up", "prefill")  # a step with a prefill counts as "prefill"

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], concurrency: int, device: str,
                 sync_steps: bool = False):
        self.engine, self.sync_steps = engine, sync_steps and device == "cuda"
        self.params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        self.queue = list(prompts)
        self.tokens = len(prompts) * NEW_TOKENS
        self.before = dict(engine.rounds_by_nodes)
        self.queued_before = engine.queued_rounds
        self.live = [engine.add_request(self.queue.pop(0), self.params) for _ in range(min(concurrency, len(self.queue)))]
        self.steps = 0
        self.seconds = {kind: 0.0 for kind in self.KINDS}
        self.counts = {kind: 0 for kind in self.KINDS}

    @property
    def done(self) -> bool:
        return not self.live

    def step(self) -> None:
        prefilling = any(r.status is not Status.RUNNING for r in self.live)
        lags = [r.drafter_lag for r in self.live]
        t0 = time.perf_counter()
        self.engine.step()
        if self.sync_steps:
            torch.cuda.synchronize()  # the work this step queued after its last sync is billed to it
        elapsed = time.perf_counter() - t0
        caught_up = any(r.drafter_lag < lag for r, lag in zip(self.live, lags))
        kind = ("prefill" if prefilling else "tree" if self.engine.last_round_nodes
                else "catch_up" if caught_up else "plain")
        self.seconds[kind] += elapsed
        self.counts[kind] += 1
        self.steps += 1
        finished = [r for r in self.live if r.finished]
        self.live = [r for r in self.live if not r.finished]
        self.live += [self.engine.add_request(self.queue.pop(0), self.params) for _ in finished if self.queue]

    def result(self, seconds: float) -> dict:
        rounds = {n: c - self.before.get(n, 0) for n, c in self.engine.rounds_by_nodes.items()
                  if c - self.before.get(n, 0)}
        return {"tokens_per_s": round(self.tokens / seconds, 2), "seconds": round(seconds, 3), "steps": self.steps,
                "rounds_by_nodes": rounds, "queued_rounds": self.engine.queued_rounds - self.queued_before,
                "step_seconds": {k: round(v, 4) for k, v in self.seconds.items()}, "step_counts": self.counts}


def run_pass(engine: LLMEngine, prompts: list[list[int]], concurrency: int, device: str) -> dict:
    """Tokens/s of one engine's closed loop, run alone until all its requests are done."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loop = ClosedLoop(engine, prompts, concurrency, device)
    while not loop.done:
        loop.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return loop.result(time.perf_counter() - start)


def run_interleaved(engines: dict, prompts: list[list[int]], concurrency: int, device: str,
                    block_steps: int | None = None) -> dict:
    """Every engine's closed loop at once, one step each in turn (so a drift of the machine's speed
    over seconds falls on all engines alike); an engine's tokens/s counts its own steps' time.
    ``block_steps``: that many steps of an engine in turn instead, synchronized and billed per
    block (its steps' own times are then not synchronized: the step kinds' times are rough)."""
    sync_steps = block_steps is None
    loops = {name: ClosedLoop(engine, prompts, concurrency, device, sync_steps=sync_steps)
             for name, engine in engines.items()}
    billed = {name: 0.0 for name in loops}
    while not all(loop.done for loop in loops.values()):
        for name, loop in loops.items():
            t0 = time.perf_counter()
            for _ in range(block_steps or 1):
                if not loop.done:
                    loop.step()
            if device == "cuda":
                torch.cuda.synchronize()
            billed[name] += time.perf_counter() - t0
    return {name: loop.result(sum(loop.seconds.values()) if sync_steps else billed[name])
            for name, loop in loops.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["qwen3-8b"], help="random weights at this shape (the GPU run)")
    parser.add_argument("--model", default="smollm2", help="target when no --shape (default: the embedded SmolLM2)")
    parser.add_argument("--draft", help="drafter when no --shape (default: the embedded one)")
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12, help="at least this many requests per pass (and 4 x level)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace-dir", type=Path, help="each engine's step trace (steps_METHOD.jsonl) goes here, "
                        "for benchmarks/step_trace_summary.py")
    parser.add_argument("--interleave", choices=["pass", "step", "block"], default="pass",
                        help="pass: engines take whole passes in rotating order; step: all engines' passes at "
                        "once, one step each in turn (each step synchronized and billed to its engine); block: "
                        "the same, --block-steps steps at a time")
    parser.add_argument("--block-steps", type=int, default=32)
    parser.add_argument("--unqueued", action="store_true", help="add a plain engine that does not queue its rounds")
    parser.add_argument("--without-sink", action="store_true", help="add a DDTree engine whose plain rounds keep "
                        "the drafter's features by concatenation + defer, not the fused sink (ddtree-no-sink)")
    parser.add_argument("--doubling-probes", action="store_true", help="add a DDTree engine whose probes back off "
                        "by doubling alone, without the probe_cost_share floor (ddtree-doubling-probes)")
    parser.add_argument("--twin", action="store_true", help="add a second plain engine like the first (none-twin): "
                        "the spread between engines that do the same work")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarize", type=Path, metavar="JSON", help="print the tables of an earlier run's --out file")
    args = parser.parse_args()
    if args.summarize:
        rows = json.loads(args.summarize.read_text())["passes"]
        names = list(dict.fromkeys(r["method"] for r in rows))
        levels = sorted({r["concurrency"] for r in rows})
        print(summarize(rows, names, levels) + "\n\n" + kind_summary(rows, names, levels))
        return
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    if args.shape:
        model, draft = (str(d) for d in write_served_pair("/tmp/flashtree-churn/qwen3-8b-shape",
                                                          "/tmp/flashtree-churn/qwen3-8b-dflash-shape"))
    else:
        model, draft = args.model, args.draft or str(shipped_drafter(args.model))
    engines = make_engines(model, draft, bool(args.shape), args.device, max(levels), args.trace_dir, args.unqueued,
                           args.without_sink, args.doubling_probes, args.twin)
    vocab = next(iter(engines.values())).model.config.vocab_size
    names = list(engines)
    rows = []
    for repeat in range(-1, args.repeats):  # repeat -1: the unmeasured warm-up pass
        for level in levels:
            prompts = workload(level, max(args.requests, 4 * level), vocab, seed=level)
            order = names[(repeat + 1) % len(names):] + names[:(repeat + 1) % len(names)]
            if args.interleave != "pass":
                block = args.block_steps if args.interleave == "block" else None
                results = run_interleaved({name: engines[name] for name in order}, prompts, level, args.device, block)
            else:
                results = {name: run_pass(engines[name], prompts, level, args.device) for name in order}
            for name, result in results.items():
                if repeat >= 0:
                    rows.append({"method": name, "concurrency": level, "repeat": repeat, **result})
                    print(json.dumps(rows[-1]), flush=True)
    for engine in engines.values():
        engine.close_traces()
    summary = summarize(rows, names, levels)
    if args.interleave != "pass":
        summary += "\n\nStep time by kind (all repeats):\n\n" + kind_summary(rows, names, levels)
    print(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "device": args.device,
                                        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                                        "torch": torch.__version__, "passes": rows}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(summary + "\n")


def kind_summary(rows: list[dict], names: list[str], levels: list[int]) -> str:
    """Per level and method, over all repeats: steps and mean ms per step of each kind (a table
    of the passes' ``step_seconds`` / ``step_counts``; passes from --interleave step carry them)."""
    kinds = ClosedLoop.KINDS
    lines = ["| concurrency | method | " + " | ".join(f"{k}: steps x ms" for k in kinds) + " | total s |",
             "| --- " * (3 + len(kinds)) + "|"]
    for level in levels:
        for name in names:
            passes = [r for r in rows if r["concurrency"] == level and r["method"] == name and "step_seconds" in r]
            if not passes:
                continue
            cells = []
            for kind in kinds:
                count = sum(r["step_counts"][kind] for r in passes)
                seconds = sum(r["step_seconds"][kind] for r in passes)
                cells.append(f"{count} x {1e3 * seconds / count:.4f}" if count else "0")
            total = sum(sum(r["step_seconds"].values()) for r in passes)
            lines.append(f"| {level} | {name} | " + " | ".join(cells) + f" | {total:.3f} |")
    return "\n".join(lines)


def summarize(rows: list[dict], names: list[str], levels: list[int]) -> str:
    """Per level: each method's median tokens/s, and its ratio to plain's pass of the same repeat."""
    lines = ["| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " | "
             + " | ".join(f"{n} / none: median [min, max]" for n in names if n != "none") + " |",
             "| --- " * (1 + len(names) + len(names) - 1) + "|"]
    for level in levels:
        at = {(r["method"], r["repeat"]): r["tokens_per_s"] for r in rows if r["concurrency"] == level}
        repeats = sorted({rep for _, rep in at})
        medians = [statistics.median(at[(n, rep)] for rep in repeats) for n in names]
        ratios = []
        for n in names:
            if n != "none":
                values = [at[(n, rep)] / at[("none", rep)] for rep in repeats]
                ratios.append(f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
        lines.append(f"| {level} | " + " | ".join(f"{m:.1f}" for m in medians) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
