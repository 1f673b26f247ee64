"""The ``flashtree`` command line: generate, chat, serve, bench, train-drafter, regenerate."""

from __future__ import annotations

import argparse
import json
import sys

from flashtree.errors import FlashtreeError

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
    from flashtree.spec.defaults import default_spec

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


def cmd_generate(args) -> None:
    llm = llm_from_args(args)
    params = sampling_from_args(args)
    if args.prompt_ids:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise FlashtreeError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        out = llm.generate([ids], params)[0]
    elif args.raw:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text,
                          "acceptance_lengths": out.acceptance_lengths, "finish_reason": out.finish_reason}))
    else:
        print(out.text)


def cmd_chat(args) -> None:
    from flashtree.chat import run_chat

    run_chat(llm_from_args(args, max_waiting=4), sampling_from_args(args), system=args.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_model_args(gen)
    add_sampling_args(gen)
    add_trace_arg(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message (sent through the chat template)")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids (no template)")
    gen.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON line with token_ids and text")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat that streams tokens")
    add_model_args(chat)
    add_sampling_args(chat)
    add_trace_arg(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=cmd_chat)

    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    """Subcommands that live with their feature (server, bench, training), when present."""
    import importlib

    for module in ("flashtree.server.cli", "flashtree.bench.cli", "flashtree.train.cli"):
        try:
            yield importlib.import_module(module).register
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("flashtree"):
                continue
            raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except FlashtreeError as err:
        print(f"flashtree: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
