"""CPU: ms per SmolLM2 target forward by new-token count (a verify pass of N - 1 tree nodes, or N
rows of a batch), split into the block-kernel products, the fused C++ ops and the rest.

Wall-clock wrappers around the pieces (this process only); "glue" is the forward's Python and the
torch ops between them (embedding, views). Context 200 committed tokens, causal new tokens, fp32,
2 threads.

    python benchmarks/cpu_forward_by_tokens.py [--tokens 1,5,8,9,16,24,32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import flashtree
from flashtree.bench.environment import environment
from flashtree.kernels.cpu import fused as cpu_kernels
from flashtree.kernels.cpu import quant_linear
from flashtree.models.batch import ForwardBatch, causal_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_profile_plain import seconds, timed  # noqa: E402  (the same wall-clock accumulators)

KERNELS = ("add_rms_norm", "silu_mul", "qkv_norm_rope_write", "tree_attention")


def install_timers(model) -> None:
    block_call = quant_linear.QuantizedLinear.__call__

    def products(self, x, bias=None):
        start = time.perf_counter()
        out = block_call(self, x, bias)
        seconds["head products" if self is model.lm_head_quant else "layer products"] += time.perf_counter() - start
        return out

    quant_linear.QuantizedLinear.__call__ = products
    for name in KERNELS:
        setattr(cpu_kernels, name, timed(name, getattr(cpu_kernels, name)))
    model.__class__.forward = timed("forward", model.__class__.forward)


def forward(model, cache, tokens: int, context: int) -> None:
    ids = torch.randint(0, 49000, (1, tokens))
    batch = ForwardBatch(input_ids=ids, positions=context + torch.arange(tokens)[None], slots=torch.tensor([0]),
                         cache_lengths=torch.tensor([context]), new_mask=causal_mask(torch.tensor([tokens]), tokens),
                         kv_len=context + tokens)
    model(batch, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,5,8,9,16,24,32")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_forward_by_tokens.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=1024)
    model, cache = llm.engine.model, llm.engine.cache
    install_timers(model)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for _ in range(3):
            forward(model, cache, tokens, args.context)
        seconds.clear()
        for _ in range(args.repeats):
            forward(model, cache, tokens, args.context)
        ms = {k: round(v * 1000 / args.repeats, 3) for k, v in seconds.items()}
        ms["glue"] = round(ms["forward"] - sum(v for k, v in ms.items() if k != "forward"), 3)
        rows.append({"tokens": tokens, **ms})
        print(json.dumps(rows[-1]), flush=True)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "context": args.context,
           "forwards_ms": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
