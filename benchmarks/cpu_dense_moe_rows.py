"""CPU: a dense float32 MoE target (random weights, a small Qwen3-MoE shape) with its products, routed experts
included, held by the block kernel over the float32 weights (the default, ``quant_kernels``: each MoE layer in
one C++ call), against the same with the experts' holders taken away (before session 29: the experts one after
another through F.linear, the rest held) and against F.linear everywhere (``--no-quant-kernels``): plain decode tokens/s,
engines alternating prompt by prompt, greedy, ``--new-tokens`` per prompt, fresh engines per variant; and
whether the two give the same tokens (they need not: F.linear's rows round otherwise).

    python benchmarks/cpu_dense_moe_rows.py --out benchmarks/results/cpu_dense_moe_rows_epyc_2026-12-06.json
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_moe import QWEN3_30B_A3B  # noqa: E402
from qwen3_8b_shape import write_config  # noqa: E402

from flashtree import LLM, SamplingParams  # noqa: E402

SHAPE = {**QWEN3_30B_A3B, "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 256, "max_position_embeddings": 4096}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = write_config("/tmp/flashtree-dense-moe", SHAPE)
    engines = {name: LLM(str(model), random_weights=True, device="cpu", dtype="float32", max_running=1,
                         max_context=512, quant_kernels=held)
               for name, held in (("block_kernel", True), ("experts_f_linear", True), ("f_linear", False))}
    model_of = engines["experts_f_linear"].engine.model
    for layer in model_of.model.layers:
        for expert in layer.mlp.experts:
            expert.gate_up_quant = expert.down_quant = None
    model_of.use_layer_stack()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, SHAPE["vocab_size"], (48,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    rates, tokens = {name: [] for name in engines}, {name: [] for name in engines}
    for prompt in prompts:
        for name, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
            tokens[name].append(out.token_ids)
    result = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "shape": SHAPE,
              "new_tokens": args.new_tokens,
              "tok_per_s_median": {name: statistics.median(r) for name, r in rates.items()},
              "tok_per_s": rates,
              "prompts_with_block_kernel_tokens": {name: sum(a == b for a, b in zip(tokens["block_kernel"], t))
                                                   for name, t in tokens.items()}}
    print(json.dumps({k: v for k, v in result.items() if k not in ("shape", "tok_per_s")}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
