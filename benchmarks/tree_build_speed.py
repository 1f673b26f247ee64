"""Tree work alone: build_tree + accept_walk, before (issue #4 reference) and after.

    python benchmarks/tree_build_speed.py --device cpu --out benchmarks/results/tree_build_speed_cpu.json
    python benchmarks/tree_build_speed.py --device cuda --out benchmarks/results/tree_build_speed_h200.json

Vocab 151,936, 15 draft positions, budgets 16/64/256/1024, batch 1 and 8. "before" is the frozen
copy in tests/support/tree_reference.py; "after" is flashtree.speculative.tree. Reported per call:
median wall time (CPU: eager; CUDA: eager and one replayed CUDA graph of the whole build + walk) and
the number of ATen ops dispatched (a TorchDispatchMode counter; views included, so it bounds
the GPU kernel launches from above). The Triton kernels must give the torch ops' outputs exactly;
whether "after" equals the frozen "before" is recorded per row (``after_matches_before``): on CUDA
they differ in how the drafter's log-normalizer is computed (rounding) and may order tied top-k
tokens differently.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels import gpu as gpu_kernels  # noqa: E402
from flashtree.kernels.gpu import tree as tree_kernels  # noqa: E402
from flashtree.speculative.tree import build_tree  # noqa: E402
from flashtree.speculative.verify import accept_walk  # noqa: E402
from tests.support.tree_reference import _reference_accept_walk, _reference_build_tree  # noqa: E402

IMPLEMENTATIONS = {
    "before": (_reference_build_tree, _reference_accept_walk),
    "after": (build_tree, accept_walk),
    # the Triton tree kernels (kernels/gpu/tree.py: expand_levels, select_nodes, accept_walk); CUDA with Triton only
    "kernel": (functools.partial(build_tree, kernel=True), functools.partial(accept_walk, kernel=True)),
}


class OpCounter(TorchDispatchMode):
    """Counts ATen ops dispatched while active (a proxy for GPU kernel launches)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def make_work(impl, budgets, budget, depth):
    build, walk = IMPLEMENTATIONS[impl]

    def work(logits):
        tree = build(logits, budgets, budget)
        choice = tree.tokens.roll(-1, dims=1)  # any target choices: the cost does not depend on them
        return tree, walk(tree, choice, depth)

    return work


def count_ops(work, logits):
    with OpCounter() as counter:
        work(logits)
    views = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "reshape",
             "alias", "t", "transpose", "as_strided", "squeeze", "detach", "lift_fresh"}
    total = sum(counter.ops.values())
    return {"aten_ops": total,
            "aten_ops_no_views": total - sum(n for op, n in counter.ops.items() if op in views),
            "topk": counter.ops["topk"], "sort": counter.ops["sort"]}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps, device):
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def graph_ms(work, logits, reps):
    """Capture work(logits) once as a CUDA graph (after a warm-up run), time replays."""
    static = logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work(static)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / reps


def graphed_ms(fn, reps=20):
    """ms per replay of ``fn()`` (no arguments) captured as one CUDA graph, by :func:`graph_ms`."""
    return graph_ms(lambda _unused: fn(), torch.empty(0, device="cuda"), reps)


def same_outputs(a, b, weight_tolerance=0.0):
    """Equal trees and walks; log weights within ``weight_tolerance`` (where the Triton kernels run,
    "after" takes the drafter's log-normalizer from topk_kernels.log_normalize_top and "before" from
    torch.logsumexp: the same float32 value up to rounding)."""
    for name, x, y in zip([*a[0]._fields, *a[1]._fields], [*a[0], *a[1]], [*b[0], *b[1]]):
        if name == "log_weights" and weight_tolerance:
            finite = torch.isfinite(y)
            if not (torch.equal(finite, torch.isfinite(x)) and torch.equal(x[~finite], y[~finite])
                    and torch.allclose(x[finite], y[finite], rtol=0.0, atol=weight_tolerance)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def bench_case(device, budget, batch, vocab, depth, reps, dtype):
    gen = torch.Generator().manual_seed(budget * 10 + batch)
    logits = (torch.randn(batch, depth, vocab, generator=gen) * 2).to(device=device, dtype=dtype)
    budgets = torch.full((batch,), budget, device=device)
    row = {"budget": budget, "batch": batch}
    outputs = {}
    for impl in [i for i in IMPLEMENTATIONS if i != "kernel" or (device.type == "cuda" and gpu_kernels.available())]:
        work = make_work(impl, budgets, budget, depth)
        outputs[impl] = work(logits)  # warm-up (prefilter cache, allocator)
        row[f"{impl}_eager_ms"] = round(median_ms(lambda: work(logits), reps, device), 3)
        if device.type == "cuda":
            row[f"{impl}_graph_ms"] = round(graph_ms(work, logits, max(reps, 20)), 4)
        for key, value in count_ops(work, logits).items():
            row[f"{impl}_{key}"] = value
    # top-k tie order and normalizer rounding may differ from the frozen reference: recorded, not asserted
    row["after_matches_before"] = same_outputs(outputs["before"], outputs["after"], weight_tolerance=1e-4)
    if "kernel" in outputs:
        if not same_outputs(outputs["after"], outputs["kernel"]):
            raise AssertionError("the tree kernels and the torch ops differ")
        row["kernel_speedup_graph"] = round(row["after_graph_ms"] / row["kernel_graph_ms"], 2)
    row["speedup_eager"] = round(row["before_eager_ms"] / row["after_eager_ms"], 2)
    if device.type == "cuda":
        row["speedup_graph"] = round(row["before_graph_ms"] / row["after_graph_ms"], 2)
    print(json.dumps(row), flush=True)
    return row


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budgets", default="16,64,256,1024")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="logits dtype (default: bf16 on CUDA, f32 on CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = [bench_case(device, budget, batch, args.vocab, args.depth, args.reps, dtype)
            for batch in map(int, args.batches.split(","))
            for budget in map(int, args.budgets.split(","))]
    result = {
        "what": "build_tree + accept_walk per call, before (reference) vs after (issue #4)",
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "vocab": args.vocab, "depth": args.depth, "logits_dtype": str(dtype),
        "sort_list_max": tree_kernels.SORT_LIST_MAX, "narrow_max": tree_kernels.NARROW_MAX,
        "reps": args.reps, "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
