"""What a plain round costs a speculative engine, against the plain engine, step by step.

Served at one row on the H200, the speculative servers' plain rounds took 0.04-0.2 ms (1-4%) longer
than the plain server's (benchmarks/journal/session-11-2026-12-02.md). A speculative engine's plain
round differs from the plain engine's in two ways: inside the round it keeps the drafter's context
features (the captured layers' outputs, written into the drafter's lag buffer: since session 15 by
the fused norm kernel, ``kernels/feature_sink.py``; before, a concatenation and ``DrafterRunner.defer``),
and every ``LAG_CAPACITY`` rounds it runs a drafter catch-up pass. This run separates the two
(session 12's ``spec-no-defer`` variant, features captured then dropped, is gone with ``defer`` in
plain rounds; ``gpu_plain_round_kernels.py`` lists the kernels instead). The engines share one target
and keep the same number of rows running; each engine takes one step in turn:

- ``none``: the plain engine;
- ``spec``: a DDTree engine whose every round is plain (``FixedNodes(0)``): features kept, catch-up;
- ``spec-no-features``: the same, its drafter given no capture layers: the plain engine's round
  plus the speculative engine's host bookkeeping;
- ``ddtree-adaptive``, ``dflash-adaptive``: DDTree-64 and DFlash engines with their adaptive policy,
  as served (only their plain rounds are timed; the policy's own host time is timed apart).

It reports each engine's step wall time (decode-only steps; median, mean, p90) and how often the
catch-up ran. Not a lossless run (``spec-no-features`` drafts from nothing); it times plain rounds.

    PYTHONPATH=. python benchmarks/gpu_plain_round_cost.py --shape qwen3-8b [--rows 1,4,16] [--steps 1500] [--out FILE]
    python benchmarks/gpu_plain_round_cost.py --rows 1 --steps 50       (CPU: the shipped SmolLM2 pair)
"""

from __future__ import annotations

import argparse
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

from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.engine.request import Status  # noqa: E402
from flashtree.models.build import load_target, resolve_dtype  # noqa: E402
from flashtree.policy import FixedNodes  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402
from flashtree.speculative.defaults import shipped_drafter  # noqa: E402

VARIANTS = ("none", "spec", "spec-no-features", "ddtree-adaptive", "dflash-adaptive")


def make_engines(model: str, draft: str, random_weights: bool, device: str, max_running: int) -> dict:
    dev = torch.device(device)
    base = EngineConfig.of(model=model, random_weights=random_weights, device=device)
    loaded = load_target(base, dev, resolve_dtype("auto", dev))
    engines = {}
    for name in VARIANTS:
        if name == "none":
            spec = SpeculationConfig(method="none")
        else:
            spec = SpeculationConfig(method="dflash", draft=draft) if name.startswith("dflash") else \
                SpeculationConfig(method="ddtree", draft=draft, budget=64)
        # unqueued: the engines take steps in turn without a sync, so one engine's queued round would
        # run inside the next engine's timed step (engine/overlap.py; engine_churn.py --interleave
        # block measures engines that queue)
        config = EngineConfig.of(spec=spec, model=model, random_weights=random_weights, device=device,
                                 max_running=max_running, max_context=2048, adaptive_spec=True,
                                 queue_plain_rounds=False)
        engine = LLMEngine(config, target=loaded)
        if name.endswith("adaptive"):
            time_policy(engine)
        elif name != "none":
            engine.policy = FixedNodes(0)  # every round plain
        if name == "spec-no-features":
            engine.proposer.capture_layers = ()  # the round keeps no features (nothing to defer)
            engine._catch_up_drafter = lambda rows, nodes: None  # and there is nothing to catch up
        engines[name] = engine
    return engines


def time_policy(engine: LLMEngine) -> None:
    """Wrap the policy's choose, record and fold_settled to add up their host time
    (``engine.policy_seconds``: [choose + record seconds, rounds, fold_settled seconds]). Where the
    device runs ahead (CUDA), the engine calls fold_settled while a round runs: off the host's
    critical path, so it is counted apart."""
    policy = engine.policy
    engine.policy_seconds = [0.0, 0, 0.0]

    def timed(method, counts: bool, into: int):
        def wrapper(*args):
            t0 = time.perf_counter()
            out = method(*args)
            engine.policy_seconds[into] += time.perf_counter() - t0
            engine.policy_seconds[1] += counts
            return out
        return wrapper

    policy.choose = timed(policy.choose, True, 0)
    policy.record = timed(policy.record, False, 0)
    policy.fold_settled = timed(policy.fold_settled, False, 2)


def policy_figures(engine: LLMEngine) -> dict:
    """The policy's host time per round since the last call (see ``time_policy``), then reset."""
    spent = engine.policy_seconds
    engine.policy_seconds = [0.0, 0, 0.0]
    if not spent[1]:
        return {}
    return {"policy_us_per_round": round(1e6 * spent[0] / spent[1], 2),  # choose + record (+ folds they make)
            "fold_meanwhile_us_per_round": round(1e6 * spent[2] / spent[1], 2)}  # while the device runs


def keep_rows(engine: LLMEngine, live: list, rows: int, rng: random.Random, vocab: int) -> list:
    """Replace finished requests so ``rows`` stay in flight (prompts of 20-60 tokens)."""
    live = [r for r in live if not r.finished]
    params = SamplingParams(max_tokens=rng.randrange(200, 400), ignore_eos=True)
    while len(live) < rows:
        prompt = [rng.randrange(3, min(500, vocab)) for _ in range(rng.randrange(20, 61))]
        live.append(engine.add_request(prompt, params))
    return live


def time_level(engines: dict, rows: int, steps: int, device: str) -> dict:
    """Each engine steps in turn; wall time of each decode-only step (no prefill in it)."""
    vocab = next(iter(engines.values())).model.config.vocab_size
    rngs = {name: random.Random(rows) for name in engines}  # the same request stream per engine
    live = {name: [] for name in engines}
    times = {name: [] for name in engines}
    catch_ups = {name: 0 for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            live[name] = keep_rows(engine, live[name], rows, rngs[name], vocab)
            decode_only = all(r.status is Status.RUNNING for r in live[name])
            lagging = [r.drafter_lag for r in live[name]]
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if decode_only and engine.last_round_nodes == 0:
                times[name].append(elapsed)
                if any(r.drafter_lag < lag for r, lag in zip(live[name], lagging)):
                    catch_ups[name] += 1
    for name, engine in engines.items():  # the next level starts from empty engines
        for req in live[name]:
            engine.abort(req.request_id)
        while engine.has_work:
            engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    result = {}
    for name, values in times.items():
        values.sort()
        if not values:  # (an adaptive engine whose drafter pays ran no plain round)
            result[name] = {"steps": 0, "median_ms": float("nan"), "mean_ms": float("nan"), "catch_up_steps": 0}
            continue
        result[name] = {"steps": len(values), "median_ms": round(1e3 * statistics.median(values), 4),
                        "mean_ms": round(1e3 * statistics.fmean(values), 4),
                        "p90_ms": round(1e3 * values[int(0.9 * (len(values) - 1))], 4),
                        "catch_up_steps": catch_ups[name]}
        if hasattr(engines[name], "policy_seconds"):
            result[name].update(policy_figures(engines[name]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["qwen3-8b"], help="random weights at this shape (the GPU run)")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--steps", type=int, default=1500, help="steps per engine per row count")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    levels = [int(x) for x in args.rows.split(",")]
    if args.shape:
        model, draft = (str(d) for d in write_served_pair("/tmp/flashtree-plain-cost/qwen3-8b-shape",
                                                          "/tmp/flashtree-plain-cost/qwen3-8b-dflash-shape"))
    else:
        model, draft = "smollm2", str(shipped_drafter("smollm2"))
    engines = make_engines(model, draft, bool(args.shape), args.device, max(levels))
    time_level(engines, levels[0], min(50, args.steps), args.device)  # warm-up: graphs, first shapes
    report = {"command": " ".join(sys.argv), "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "levels": {}}
    for rows in levels:
        report["levels"][rows] = level = time_level(engines, rows, args.steps, args.device)
        print(json.dumps({"rows": rows, **level}), flush=True)
    print("| rows | " + " | ".join(f"{n} median / mean ms" for n in VARIANTS) + " | spec catch-up steps | "
          "policy us per round, critical path (+ folds while the device runs) (ddtree / dflash) |")
    print("| --- " * (len(VARIANTS) + 3) + "|")
    for rows, level in report["levels"].items():
        cells = " | ".join(f"{level[n]['median_ms']:.3f} / {level[n]['mean_ms']:.3f}" for n in VARIANTS)
        policy = " / ".join(f"{level[n].get('policy_us_per_round')} (+{level[n].get('fold_meanwhile_us_per_round')})"
                            for n in ("ddtree-adaptive", "dflash-adaptive"))
        print(f"| {rows} | {cells} | {level['spec']['catch_up_steps']} | {policy} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
