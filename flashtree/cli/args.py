"""The flags every model-loading subcommand shares, and what they build: sampling params, an LLM."""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "smollm2"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags that pick and place the models; shared by every subcommand that loads one."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="HF directory, hub id, .gguf file, or 'smollm2' (the embedded default)")
    parser.add_argument("--random-weights", action="store_true",
                        help="initialize random weights from the model's config.json (speed tests)")
    parser.add_argument("--spec", default=None, choices=["none", "dflash", "ddtree"],
                        help="decoding method (default: ddtree when a drafter is known, else none)")
    parser.add_argument("--draft", default=None, help="DFlash drafter directory or hub id")
    parser.add_argument("--budget", type=int, default=None, help="DDTree node budget")
    parser.add_argument("--block-size", type=int, default=None, help="lower the drafter's block size")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="draft from the drafter's N most frequent tokens only (its draft_vocab.safetensors "
                             "ranking): a cheaper draft head, lossless as ever; 0: the whole vocabulary "
                             "(default: 16384 on a CPU when the drafter ships a ranking, else 0)")
    parser.add_argument("--adaptive-spec", action=argparse.BooleanOptionalAction, default=None,
                        help="pick each round's draft size (down to plain decoding) for the most tokens/s; "
                             "the budget becomes a maximum (default: on, except in bench)")
    parser.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default=None, help="auto (default: bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--max-context", type=int, default=2048, help="prompt + output tokens per request")
    parser.add_argument("--max-running", type=int, default=8, help="requests decoded together")
    parser.add_argument("--no-quant-kernels", action="store_true",
                        help="CPU fp32 GGUF models: multiply every product by the dequantized fp32 weights "
                             "(default: decode-sized products read the GGUF blocks with an AVX-512 / AVX2 kernel)")
    parser.add_argument("--trace-policy", default=None, metavar="FILE",
                        help="write each round's adaptive-speculation choice, time and estimates as JSON lines")
    parser.add_argument("--trace-steps", default=None, metavar="FILE",
                        help="write each engine step's round, prefill and the gap before it (ms) as JSON lines")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="CPU: run norms, rotary and KV writes as plain torch ops "
                             "(default: fused C++ kernels where the AVX-512 / AVX2 kernel library builds)")
    parser.add_argument("--no-gpu-kernels", action="store_true",
                        help="CUDA: run norms, rotary and KV writes as plain torch ops "
                             "(default: fused Triton kernels when Triton is installed)")
    parser.add_argument("--triton-attention", action=argparse.BooleanOptionalAction, default=False,
                        help="CUDA: attention with the Triton kernel that reads the KV cache by slot (no gather "
                             "of scattered rows; one CUDA graph for every context length) instead of SDPA "
                             "(default: off, except in regenerate)")
    parser.add_argument("--triton-tree", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: DDTree tree work (kept lists, node selection, accept walk) in Triton kernels "
                             "(same trees; default: on)")
    parser.add_argument("--queue-plain-rounds", action=argparse.BooleanOptionalAction, default=None,
                        help="queue the next plain round on the device before reading this one's results, so the "
                             "host's work between rounds overlaps the device's (same tokens; default: on CUDA)")


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-trees", default=None, metavar="FILE",
                        help="write each round's tree and accepted path as JSON lines (runs rounds eagerly)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args):
    from flashtree.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def llm_from_args(args, **extra):
    from flashtree.llm import LLM
    from flashtree.speculative.defaults import default_spec

    spec, draft = default_spec(args.model, args.spec, args.draft)
    return LLM(args.model, spec=spec, draft=draft, budget=args.budget, block_size=args.block_size,
               draft_vocab=args.draft_vocab,
               device=args.device, dtype=args.dtype, random_weights=args.random_weights,
               max_context=args.max_context, max_running=args.max_running,
               trace_trees=getattr(args, "trace_trees", None), adaptive_spec=adaptive_spec_of(args),
               quant_kernels=not getattr(args, "no_quant_kernels", False),
               gpu_kernels=not getattr(args, "no_gpu_kernels", False),
               cpu_kernels=not getattr(args, "no_cpu_kernels", False), trace_policy=args.trace_policy,
               trace_steps=args.trace_steps, triton_attention=args.triton_attention, triton_tree=args.triton_tree,
               queue_plain_rounds=getattr(args, "queue_plain_rounds", None), **extra)


def adaptive_spec_of(args, default: bool = True) -> bool:
    """``--adaptive-spec`` / ``--no-adaptive-spec``, or ``default`` when neither was given."""
    value = getattr(args, "adaptive_spec", None)
    return default if value is None else value
