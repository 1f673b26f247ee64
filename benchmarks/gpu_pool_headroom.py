"""Does the page pool keep the device within ``gpu_memory_utilization`` through the widest eager rounds? (#39)

The engine of ``tests/gpu/test_paged_kv.py::test_pool_leaves_room_for_the_widest_rounds`` (a tiny DDTree-32 pair
with a 32,000-token vocabulary, 64 running rows), sized to the memory in use plus ``--headroom`` of the device,
runs 64 sampled requests with top-p and log-probabilities (rounds with no graph: eager, the widest the reserve
measures). Reports the activation reserve, the device's memory in use after start-up and after the rounds
against the target, how far past it the rounds went, and how much of that growth was the caching allocator's. ``--warm-up off``: without the start-up warm-up.

    python benchmarks/gpu_pool_headroom.py --headroom 0.1 --out benchmarks/results/gpu_pool_headroom_h100.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.engine.graphs import GraphCache  # noqa: E402
from flashtree.engine.runner import ModelRunner  # noqa: E402
from tests.dflash_helpers import tiny_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction of the device above what is in use")
    parser.add_argument("--warm-up", choices=("on", "off"), default="on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pair = tiny_pair(tempfile.mkdtemp(), vocab=32000, block_size=16)
    captures = _record_captures()
    free, total = torch.cuda.mem_get_info()
    target = (total - free) / total + args.headroom
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=32, adaptive_spec=False, device="cuda",
              dtype="bfloat16", gpu_memory_utilization=target, max_context=512, max_running=64,
              warm_up=args.warm_up == "on")
    after_start = (total - torch.cuda.mem_get_info()[0]) / total
    reserved_start, allocated_start = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.9, logprobs=2, seed=1)
    llm.generate([[1 + i % 30, 2, 3] for i in range(64)], params)
    after = (total - torch.cuda.mem_get_info()[0]) / total
    reserved_after = torch.cuda.memory_reserved()
    reserve = llm.engine.activation_reserve
    report = {"device": torch.cuda.get_device_name(), "headroom": args.headroom, "warm_up": args.warm_up == "on",
              "target": target, "in_use_after_start": after_start, "in_use_after_rounds": after,
              "over_target_mib": (after - target) * total / 2**20,
              "reserve_mib": {name: value / 2**20 for name, value in reserve._asdict().items()},
              "pool_pages": llm.engine.pages.pool.capacity,
              # where the rounds' memory went: the caching allocator's growth (its peak, and what it keeps), and the
              # device memory outside it (kernel modules loaded, library workspaces)
              "allocator_growth_mib": (reserved_after - reserved_start) / 2**20,
              "allocator_peak_growth_mib": (torch.cuda.max_memory_reserved() - reserved_start) / 2**20,
              "allocated_peak_growth_mib": (torch.cuda.max_memory_allocated() - allocated_start) / 2**20,
              "captures": captures,
              "outside_allocator_growth_mib": ((after - after_start) * total - (reserved_after - reserved_start)) / 2**20}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


def _record_captures() -> dict:
    """Wraps ModelRunner.capture_graphs: the start-up captures' graphs and their growth of the device's memory in
    use and of the caching allocator's reserved memory (the graphs' pool is part of it), in MiB; and each capture's
    own growth of both (GraphCache._capture, the warm-up run on its side stream included)."""
    record, capture, capture_one = {"each": []}, ModelRunner.capture_graphs, GraphCache._capture

    def recorded_one(cache, fn, inputs):
        torch.cuda.synchronize()
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        captured = capture_one(cache, fn, inputs)
        torch.cuda.synchronize()
        record["each"].append([round((free - torch.cuda.mem_get_info()[0]) / 2**20, 1),
                               round((torch.cuda.memory_reserved() - reserved) / 2**20, 1)])
        return captured

    def recorded(runner, keys):
        keys = list(keys)
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        capture(runner, keys)
        record.update(graphs=len(keys), in_use_growth_mib=(free - torch.cuda.mem_get_info()[0]) / 2**20,
                      allocator_growth_mib=(torch.cuda.memory_reserved() - reserved) / 2**20)

    ModelRunner.capture_graphs = recorded
    GraphCache._capture = recorded_one
    return record


if __name__ == "__main__":
    main()
