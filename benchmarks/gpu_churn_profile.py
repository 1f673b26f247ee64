"""H200: where a speculative engine loses time to the plain engine under churn (requests finishing
and replaced, drafter catch-ups, probes), as engine_churn.py runs them.

In steady decode (no request finishing) a speculative engine's plain rounds cost what the plain
engine's do (gpu_plain_round_kernels.py, session 15), while engine_churn.py puts the speculative
engines 0.4-1% below plain. This run takes one closed-loop pass per engine (engine_churn's workload,
engines as served: plain, DDTree-64, DFlash, adaptive, rounds queued) under torch.profiler's CUDA
activity, after an unprofiled warm-up pass, and reports per pass:

- wall time, kernel time (sum of kernel durations), kernels, device idle (between the first and
  the last kernel of the pass, not covered by a kernel or copy), all per step;
- host wait: time the host spent blocked on a round's results (``ModelRunner.finish``); a host that
  waits is ahead of the device, a step with no wait had the device waiting for the host instead;
- Python garbage collections during the pass (count and time by generation);
- kernel time by kind: the top kernels whose time differs from the plain engine's;
- the device's idle gaps binned by length, and the longest ones with the operations around them.

    PYTHONPATH=. python benchmarks/gpu_churn_profile.py [--levels 1,32] [--requests 4] [--engines none,ddtree,dflash]
        [--host-ops] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flashtree, without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_churn import ClosedLoop, make_engines, workload  # noqa: E402
from gpu_plain_round_kernels import diff_table, kernel_figures, write_report  # noqa: E402
from qwen3_8b_shape import write_served_pair  # noqa: E402


class HostWait:
    """Adds up the time ``runner.finish`` spends blocked on the device, and the steps that waited
    under 50 us (the device was idle or about to be)."""

    def __init__(self, runner):
        self.seconds, self.rounds, self.short = 0.0, 0, 0
        original = runner.finish

        def finish(launched, meanwhile=None):
            if meanwhile is not None:
                meanwhile()
            t0 = time.perf_counter()
            if launched.done is not None:
                launched.done.synchronize()
            waited = time.perf_counter() - t0
            self.seconds += waited
            self.rounds += 1
            self.short += waited < 50e-6
            return original(launched)

        runner.finish = finish


class GcTimer:
    """Collections by generation during a window, and their time."""

    def __init__(self):
        self.counts, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0


GAP_BINS_US = (5, 50, 500)  # device idle gaps binned: < 5 us, 5-50, 50-500, >= 500


HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "python_function")  # host events of a --host-ops trace


def host_work_during(events: list[dict], start: float, end: float, top: int = 6) -> list:
    """The host events (``--host-ops``) that overlap most of [start, end), the innermost first among
    those that overlap it as much (a Python frame's callers cover it too): [name, us inside, us long]."""
    overlaps = []
    for e in events:
        inside = min(end, e["ts"] + e.get("dur", 0)) - max(start, e["ts"])
        if inside > 0:
            overlaps.append((-round(inside), e.get("dur", 0), e["name"][:70]))
    return [[name, -us, round(dur, 1)] for us, dur, name in sorted(overlaps)[:top]]


def idle_gaps(trace: Path, top: int = 12) -> dict:
    """The device's idle gaps between consecutive kernels or copies of the pass: count and total us
    per bin of ``GAP_BINS_US``, and the ``top`` longest with the operations on either side (and, in
    a trace with host events, the host work that overlaps them most)."""
    events = json.loads(trace.read_text())["traceEvents"]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("ph") == "X"]
    ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    gaps, end, before = [], None, None
    for e in ops:
        if end is not None and e["ts"] > end:
            gaps.append((e["ts"] - end, before["name"][:60], e["name"][:60], end))
        if end is None or e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e
    bins = {}
    for low, high in zip((0,) + GAP_BINS_US, GAP_BINS_US + (float("inf"),)):
        inside = [g[0] for g in gaps if low <= g[0] < high]
        bins[f"{low}-{high}us"] = [len(inside), round(sum(inside), 1)]
    longest = sorted(gaps, reverse=True)[:top]
    return {"bins": bins, "longest": [[round(g, 1), a, b] + ([host_work_during(host, at, at + g)] if host else [])
                                      for g, a, b, at in longest]}


def profiled_pass(engine, prompts, concurrency: int, out: Path, name: str, host_ops: bool = False) -> tuple[dict, dict]:
    waits, collections = HostWait(engine.runner), GcTimer()
    torch.cuda.synchronize()
    loop = ClosedLoop(engine, prompts, concurrency, "cuda")
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_ops else [])
    with profile(activities=activities, with_stack=host_ops) as prof:
        t0 = time.perf_counter()
        while not loop.done:
            loop.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gc.callbacks.remove(collections._callback)
    trace = out / f"trace_{name}_{concurrency}.json"
    prof.export_chrome_trace(str(trace))
    totals, kernels = kernel_figures(trace, loop.steps)
    totals["gaps"] = idle_gaps(trace)
    trace.unlink()
    totals.update(steps=loop.steps, wall_us=1e6 * wall / loop.steps, host_wait_us=1e6 * waits.seconds / loop.steps,
                  rounds_waiting_under_50us=waits.short, rounds=waits.rounds, gc_counts=collections.counts,
                  gc_ms=[round(1e3 * s, 2) for s in collections.seconds],
                  rounds_by_nodes={n: c - loop.before.get(n, 0) for n, c in engine.rounds_by_nodes.items()
                                   if c - loop.before.get(n, 0)},
                  step_counts=loop.counts)
    return totals, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--requests", type=int, default=4, help="at least this many requests per pass (and 4 x level)")
    parser.add_argument("--engines", default="none,ddtree,dflash", help="which of engine_churn's engines to profile")
    parser.add_argument("--host-ops", action="store_true", help="also trace host ops and Python frames, and name "
                        "the host work during the longest idle gaps (a much larger trace)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/churn-profile"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, draft = (str(d) for d in write_served_pair("/tmp/flashtree-churn/qwen3-8b-shape",
                                                      "/tmp/flashtree-churn/qwen3-8b-dflash-shape"))
    levels = [int(x) for x in args.levels.split(",")]
    wanted = args.engines.split(",")
    engines = {name: e for name, e in make_engines(model, draft, True, "cuda", max(levels)).items() if name in wanted}
    vocab = next(iter(engines.values())).model.config.vocab_size
    report, lines = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "levels": {}}, []
    for level in levels:
        prompts = workload(level, max(args.requests, 4 * level), vocab, seed=level)
        figures = report["levels"][level] = {}
        for name, engine in engines.items():
            warm = ClosedLoop(engine, prompts, level, "cuda")  # graphs, policy exploration
            while not warm.done:
                warm.step()
            totals, kernels = profiled_pass(engine, prompts, level, args.out, name, args.host_ops)
            figures[name] = {"totals": totals, "kernels": kernels}
            print(json.dumps({"level": level, "engine": name, **totals}), flush=True)
        lines += [f"\n### concurrency {level}\n", "| engine | steps | wall us/step | kernel us/step | kernels/step | "
                  "device idle us/step | host wait us/step | rounds waiting < 50 us | gc gen0/1/2 (ms) | rounds by nodes |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in engines:
            t = figures[name]["totals"]
            gcs = " / ".join(f"{c} ({ms})" for c, ms in zip(t["gc_counts"], t["gc_ms"]))
            lines.append(f"| {name} | {t['steps']} | {t['wall_us']:.1f} | {t['kernel_us']:.1f} | {t['kernels']:.1f} | "
                         f"{t['device_idle_us']:.1f} | {t['host_wait_us']:.1f} | {t['rounds_waiting_under_50us']} of "
                         f"{t['rounds']} | {gcs} | {t['rounds_by_nodes']} |")
        lines += ["", "| engine | idle gaps by length: count, total us |", "| --- | --- |"]
        lines += [f"| {name} | {figures[name]['totals']['gaps']['bins']} |" for name in engines]
        for name in engines:
            lines += ["", f"{name}, longest idle gaps (us, operation before, operation after):"]
            lines += [f"- {g}" for g in figures[name]["totals"]["gaps"]["longest"]]
        for name in [n for n in engines if n != "none" and "none" in engines]:
            lines += [""] + diff_table(figures["none"]["kernels"], figures[name]["kernels"], name)[:14]
    write_report(args.out, "churn_profile", lines, report)


if __name__ == "__main__":
    main()
