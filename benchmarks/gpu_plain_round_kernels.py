"""H200: what the device runs in a speculative engine's plain round that the plain engine's does not.

engine_churn.py (session 14) put a speculative engine's plain rounds 8-29 us above the plain
engine's at 1-32 rows, with queued rounds. This run profiles steady decode steps (no prefill, no
finished request) of engines that each keep ``rows`` requests in flight, one engine at a time,
with torch.profiler's CUDA activity, and reports per step:

- wall time, kernel time (sum of kernel durations), kernels launched, memcpy/memset operations,
  and the device's idle time between the first and the last kernel of the profiled steps;
- the kernels whose per-step count or time differs from the plain engine's (the diff table).

Engines (one target's weights, rounds queued as served on CUDA): ``none`` (plain) and ``spec``
(a DDTree-64 engine, every round plain: ``FixedNodes(0)``). Session 15's first run (before the
feature sink) also had ``spec-no-defer`` (features captured, then dropped) and ``spec-no-features``
(no capture layers); the second was not comparable (its rounds were not queued), so both are gone.

    PYTHONPATH=. python benchmarks/gpu_plain_round_kernels.py [--rows 1,32] [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flashtree, without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import write_served_pair  # noqa: E402

from flashtree.config import EngineConfig, SpeculationConfig  # noqa: E402
from flashtree.engine.engine import LLMEngine  # noqa: E402
from flashtree.models.build import load_target, resolve_dtype  # noqa: E402
from flashtree.policy import FixedNodes  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402

ENGINES = ("none", "spec")


def make_engine(name: str, model: str, draft: str, loaded, rows: int) -> LLMEngine:
    spec = SpeculationConfig(method="none") if name == "none" else \
        SpeculationConfig(method="ddtree", draft=draft, budget=64)
    config = EngineConfig.of(spec=spec, model=model, random_weights=True, device="cuda", max_running=rows,
                             max_context=2048, adaptive_spec=True)
    engine = LLMEngine(config, target=loaded)
    if name != "none":
        engine.policy = FixedNodes(0)  # every round plain
    return engine


def start(engine: LLMEngine, rows: int, vocab: int) -> None:
    """``rows`` requests of 40-token random prompts that outlast the run, prefilled."""
    rng = random.Random(rows)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    for _ in range(rows):
        engine.add_request([rng.randrange(3, min(500, vocab)) for _ in range(40)], params)
    for _ in range(6):  # prefill, first graph captures
        engine.step()


def kernel_figures(trace: Path, steps: int) -> tuple[dict, dict]:
    """(totals per step, {kernel name: [count per step, us per step]}) from a chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        entry = by_name[e["name"][:90]]
        entry[0] += 1
        entry[1] += e["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels + copies)
    busy, end = 0.0, None
    for a, b in spans:  # union of busy intervals
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    first, last = spans[0][0], max(b for _, b in spans)
    totals = {"kernels": len(kernels) / steps, "kernel_us": sum(e["dur"] for e in kernels) / steps,
              "copies": len(copies) / steps, "copy_us": sum(e["dur"] for e in copies) / steps,
              "device_idle_us": (last - first - busy) / steps}
    return totals, {k: [v[0] / steps, v[1] / steps] for k, v in by_name.items()}


def profile_engine(engine: LLMEngine, rows: int, steps: int, out: Path, name: str) -> tuple[dict, dict]:
    start(engine, rows, engine.model.config.vocab_size)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    trace = out / f"trace_{name}_{rows}.json"
    prof.export_chrome_trace(str(trace))
    totals, kernels = kernel_figures(trace, steps)
    trace.unlink()  # large; the figures are kept
    totals["wall_us"] = 1e6 * wall / steps
    return totals, kernels


def diff_table(base: dict, other: dict, name: str) -> list[str]:
    lines = [f"| kernel | none count/step | {name} count/step | none us/step | {name} us/step |",
             "| --- | --- | --- | --- | --- |"]
    for k in sorted(set(base) | set(other), key=lambda k: -abs(other.get(k, [0, 0])[1] - base.get(k, [0, 0])[1])):
        a, b = base.get(k, [0, 0.0]), other.get(k, [0, 0.0])
        if abs(a[0] - b[0]) > 0.01 or abs(a[1] - b[1]) > 0.5:
            lines.append(f"| `{k}` | {a[0]:.2f} | {b[0]:.2f} | {a[1]:.1f} | {b[1]:.1f} |")
    return lines


def write_report(out: Path, stem: str, lines: list[str], report: dict) -> None:
    """Print the markdown ``lines`` and write them to ``out/stem.md``, ``report`` to ``out/stem.json``."""
    text = "\n".join(lines) + "\n"
    print(text)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("/tmp/plain-round-kernels"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, draft = (str(d) for d in write_served_pair("/tmp/flashtree-plain-kernels/qwen3-8b-shape",
                                                      "/tmp/flashtree-plain-kernels/qwen3-8b-dflash-shape"))
    dev = torch.device("cuda")
    loaded = load_target(EngineConfig.of(model=model, random_weights=True, device="cuda"), dev,
                         resolve_dtype("auto", dev))
    names = ENGINES
    report, lines = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "levels": {}}, []
    for rows in (int(x) for x in args.rows.split(",")):
        level = report["levels"][rows] = {}
        for name in names:
            engine = make_engine(name, model, draft, loaded, rows)
            totals, kernels = profile_engine(engine, rows, args.steps, args.out, name)
            level[name] = {"totals": totals, "kernels": kernels}
            print(json.dumps({"rows": rows, "engine": name, **{k: round(v, 2) for k, v in totals.items()}}), flush=True)
            del engine
            torch.cuda.empty_cache()
        lines += [f"\n### {rows} rows\n", "| engine | wall us/step | kernel us/step | kernels/step | copies/step | "
                  "copy us/step | device idle us/step |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in names:
            t = level[name]["totals"]
            lines.append(f"| {name} | {t['wall_us']:.1f} | {t['kernel_us']:.1f} | {t['kernels']:.2f} | "
                         f"{t['copies']:.2f} | {t['copy_us']:.1f} | {t['device_idle_us']:.1f} |")
        for name in names[1:]:
            lines += [""] + diff_table(level["none"]["kernels"], level[name]["kernels"], name)
    write_report(args.out, "plain_round_kernels", lines, report)


if __name__ == "__main__":
    main()
