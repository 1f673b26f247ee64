"""H100 / H200: the fast tree attention (kernels/gpu/attention.py) per launch tile at the round shapes, against
the bytes it must read (issue #39: at batch 32 a DDTree-16 verify's attention took 417 us a layer on an H100,
about 9x its K/V bytes).

    python benchmarks/gpu_tree_attention.py --out benchmarks/results/gpu_tree_attention_h100.json

Qwen3-8B's head layout (32 query heads, 8 kv heads, head dim 128), 16-entry pages in shuffled order, about
``--context`` committed entries a row (lengths differ by up to 64). Forwards: a plain step (1 token), DDTree-4,
-16 and -64 trees (5 / 17 / 65 nodes with the root; random trees, parents before children), a DFlash block of
16 (causal), and the drafter's block of 16 (every block token sees the whole block). Each configuration is
timed as a CUDA graph of ``--layers`` calls, each on its own layer's K/V (so the keys do not stay in L2), CUDA
events around ``--reps`` replays, in microseconds per layer; its output is checked against the default tile's.
The search per forward: block_m x warps together, then key splits, then block_n, then pipeline stages, each
step keeping the best so far. The floor is the K/V, query and output bytes at the card's effective bandwidth
(round_roofline.py).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.attention import AttentionTile, default_tile, tree_attention  # noqa: E402
from gpu_exact_attention import random_tree_mask  # noqa: E402  (benchmarks/ is the script's directory)
from gpu_fp8 import time_calls_us  # noqa: E402
from round_roofline import machine_of  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
FORWARDS = {"plain": (1, "causal"), "ddtree4": (5, "tree"), "dflash16": (16, "causal"), "ddtree16": (17, "tree"),
            "ddtree64": (65, "tree"), "drafter16": (16, "all")}


SEARCH_STAGES = ("block_m x warps", "splits", "block_n", "stages")


def forward_inputs(batch: int, new: int, kind: str, context: int, layers: int, gen: torch.Generator,
                   max_context: int = 2048, device: str = "cuda") -> dict:
    """One forward's tensors; the block table is ``max_context`` entries wide like the engine's (its width sets
    the default key splits), its first pages real and shuffled."""
    pages_per_slot = -(-(context + 64 + new) // PAGE)
    pages = batch * pages_per_slot
    table = torch.zeros(batch, max(pages_per_slot, -(-max_context // PAGE)), dtype=torch.long)
    table[:, :pages_per_slot] = torch.randperm(pages, generator=gen).view(batch, pages_per_slot)
    k = torch.randn(layers, pages, KV_HEADS, PAGE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    lengths = (context + torch.randint(0, 64, (batch,), generator=gen)).to(device)
    if kind == "tree":
        mask = torch.stack([random_tree_mask(new, gen) for _ in range(batch)])
    elif kind == "causal":
        mask = torch.ones(new, new, dtype=torch.bool).tril().expand(batch, new, new)
    else:
        mask = torch.ones(batch, new, new, dtype=torch.bool)
    return {"q": torch.randn(batch, HEADS, new, HEAD_DIM, device=device, dtype=torch.bfloat16),
            "k": k, "v": torch.randn_like(k), "lengths": lengths, "mask": mask.to(device).contiguous(),
            "table": table.to(device), "slots": torch.arange(batch, device=device)}


def attend(inputs: dict, layer: int, tile: AttentionTile) -> torch.Tensor:
    return tree_attention(inputs["q"], inputs["k"][layer], inputs["v"][layer], inputs["table"], inputs["slots"],
                          inputs["lengths"], inputs["mask"], tile=tile)


def graphed_us_per_layer(inputs: dict, tile: AttentionTile, layers: int, reps: int) -> float:
    return time_calls_us([lambda layer=layer: attend(inputs, layer, tile) for layer in range(layers)], "cuda", reps)


def floor_us(inputs: dict, bandwidth: float) -> float:
    q = inputs["q"]
    b, _, n, d = q.shape
    keys = int(inputs["lengths"].sum()) + b * n
    kv_bytes = keys * KV_HEADS * d * 2 * 2
    return (kv_bytes + 2 * q.numel() * 2) / bandwidth * 1e6


def candidates(stage: str, best: AttentionTile) -> list[AttentionTile]:
    if stage == "block_m x warps":
        return [best._replace(block_m=m, warps=w) for m in (16, 32, 64, 128) for w in (4, 8)]
    if stage == "splits":
        return [best._replace(splits=s) for s in (None, 1, 2, 4, 8, 16)]
    if stage == "block_n":
        return [best._replace(block_n=n) for n in (32, 64, 128)]
    return [best._replace(stages=s) for s in (1, 2, 3, 4)]


def search(inputs: dict, layers: int, reps: int, stages: tuple[str, ...] = SEARCH_STAGES) -> dict:
    n = inputs["q"].shape[2]
    default = default_tile(n * HEADS // KV_HEADS, inputs["q"].dtype)
    reference = attend(inputs, 0, default)
    timed: dict[AttentionTile, dict] = {}

    def measure(tile: AttentionTile) -> float:
        if tile not in timed:
            try:
                diff = (attend(inputs, 0, tile).float() - reference.float()).abs().max().item()
                us = graphed_us_per_layer(inputs, tile, layers, reps) if diff <= 2e-2 else float("inf")
                timed[tile] = {"tile": tile._asdict(), "us": us, "max_abs_diff": diff}
            except (OutOfResources, RuntimeError) as error:  # a tile too large for shared memory or registers
                timed[tile] = {"tile": tile._asdict(), "us": float("inf"), "error": str(error)[:200]}
        return timed[tile]["us"]

    best = default
    measure(default)
    for stage in stages:
        best = min(candidates(stage, best), key=measure)
    return {"default": timed[default], "best": timed[best], "tried": list(timed.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--forwards", default=",".join(FORWARDS))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--default-only", action="store_true", help="time the default tile only (a kernel A/B)")
    args = parser.parse_args()
    machine = machine_of(torch.cuda.get_device_name())
    rows, started = [], time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in map(int, args.batches.split(",")):
        for name in args.forwards.split(","):
            new, kind = FORWARDS[name]
            gen = torch.Generator().manual_seed(batch * 1000 + new)
            inputs = forward_inputs(batch, new, kind, args.context, args.layers, gen)
            row = {"batch": batch, "forward": name, "new_tokens": new, "floor_us": floor_us(inputs, machine.bandwidth),
                   **search(inputs, args.layers, args.reps, () if args.default_only else SEARCH_STAGES)}
            rows.append(row)
            print(f"b={batch:3d} {name:9s} floor {row['floor_us']:7.1f} us  default {row['default']['us']:7.1f}  "
                  f"best {row['best']['us']:7.1f} {row['best']['tile']}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "machine": vars(machine),
                                            "context": args.context, "layers": args.layers, "rows": rows},
                                           indent=1))  # after each row: a cut-off run keeps its rows
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
