"""Does the page pool keep the device within ``gpu_memory_utilization`` through the widest eager rounds? (#39)

The engine of ``tests/gpu/test_paged_kv.py::test_pool_leaves_room_for_the_widest_rounds`` (a tiny DDTree-32 pair
with a 32,000-token vocabulary, 64 running rows), sized to the memory in use plus ``--headroom`` of the device,
runs 64 sampled requests with top-p and log-probabilities (rounds with no graph: eager, the widest the reserve
measures). Reports the activation reserve, the device's memory in use after start-up and after the rounds
against the target, and how far past it the rounds went. ``--warm-up off``: without the start-up warm-up.

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
from tests.dflash_helpers import tiny_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction of the device above what is in use")
    parser.add_argument("--warm-up", choices=("on", "off"), default="on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pair = tiny_pair(tempfile.mkdtemp(), vocab=32000, block_size=16)
    free, total = torch.cuda.mem_get_info()
    target = (total - free) / total + args.headroom
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=32, adaptive_spec=False, device="cuda",
              dtype="bfloat16", gpu_memory_utilization=target, max_context=512, max_running=64,
              warm_up=args.warm_up == "on")
    after_start = (total - torch.cuda.mem_get_info()[0]) / total
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.9, logprobs=2, seed=1)
    llm.generate([[1 + i % 30, 2, 3] for i in range(64)], params)
    after = (total - torch.cuda.mem_get_info()[0]) / total
    reserve = llm.engine.activation_reserve
    report = {"device": torch.cuda.get_device_name(), "headroom": args.headroom, "warm_up": args.warm_up == "on",
              "target": target, "in_use_after_start": after_start, "in_use_after_rounds": after,
              "over_target_mib": (after - target) * total / 2**20,
              "reserve_mib": {name: value / 2**20 for name, value in reserve._asdict().items()},
              "pool_pages": llm.engine.pages.pool.capacity}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
