"""The engine flags every model-loading subcommand shares, grouped as the configs are, and what they build.

Every field of :class:`~flashtree.config.EngineConfig`'s sections (but the adaptive policy's tuning
knobs) has a flag here, with the config's default shown in ``--help``; :func:`engine_config_from_args`
turns the parsed flags back into the config. A subcommand changes a default with
``parser.set_defaults`` (``regenerate`` runs 256 rows with the Triton attention, for example).
"""

from __future__ import annotations

import argparse
import dataclasses

from flashtree.config import (
    DISTRIBUTED_EXECUTORS,
    GRAMMAR_BACKENDS,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    KernelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculationConfig,
    TargetConfig,
    TraceConfig,
)

DEFAULT_MODEL = TargetConfig.model
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter  # every subcommand shows its defaults


def _graph_tokens(text: str) -> int | None:
    """``--cuda-graph-max-tokens``: a positive integer, or ``lazy`` (None)."""
    if text == "lazy":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'lazy', got {text!r}") from None


def _on_off(group, name: str, default: bool | None, text: str) -> None:
    group.add_argument(f"--{name.replace('_', '-')}", dest=name, action=argparse.BooleanOptionalAction,
                       default=default, help=text)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, one group per config section."""
    target = parser.add_argument_group("model (TargetConfig)")
    target.add_argument("--model", default=TargetConfig.model,
                        help="HF directory, hub id, .gguf file, or 'smollm2' (the embedded default)")
    target.add_argument("--device", default=TargetConfig.device, help="auto (None), cpu, cuda, cuda:N")
    target.add_argument("--dtype", default=TargetConfig.dtype,
                        help="auto (None: bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    target.add_argument("--random-weights", action="store_true", default=TargetConfig.random_weights,
                        help="initialize random weights from the model's config.json (speed tests)")
    target.add_argument("--weights-seed", dest="seed", type=int, default=TargetConfig.seed,
                        help="seed of the random weights (the drafter's: this + 1)")

    spec = parser.add_argument_group("speculation (SpeculationConfig)")
    spec.add_argument("--spec", default=None, choices=SPEC_METHODS,
                      help="decoding method (None: ddtree when a drafter is known, else none)")
    spec.add_argument("--draft", default=SpeculationConfig.draft,
                      help="DFlash drafter directory or hub id (None: the shipped one for smollm2)")
    spec.add_argument("--budget", type=int, default=SpeculationConfig.budget,
                      help="DDTree node budget (None: 64 on CUDA, 4 on a CPU)")
    spec.add_argument("--block-size", type=int, default=SpeculationConfig.block_size,
                      help="lower the drafter's block size (None: the checkpoint's)")
    spec.add_argument("--draft-vocab", type=int, default=SpeculationConfig.draft_vocab, metavar="N",
                      help="draft from the drafter's N most frequent tokens only (its draft_vocab.safetensors "
                           "ranking): a cheaper draft head, lossless as ever; 0: the whole vocabulary "
                           "(None: 16384 on a CPU when the drafter ships a ranking, else 0)")
    _on_off(spec, "adaptive_spec", SpeculationConfig.adaptive,
            "pick each round's draft size (down to plain decoding) for the most tokens/s; the budget becomes a maximum")
    _on_off(spec, "policy_cache", SpeculationConfig.policy_cache,
            "the adaptive choice starts from what the last run of the same model, drafter and machine learned, "
            "and keeps what it learns (a small JSON per setup under $FLASHTREE_POLICY_CACHE, else the cache "
            "directory's policy/)")

    cache = parser.add_argument_group("KV cache (CacheConfig)")
    cache.add_argument("--max-context", "--max-model-len", type=int, default=CacheConfig.max_context,
                       help="prompt + output tokens per request")
    cache.add_argument("--page-size", type=int, default=CacheConfig.page_size, help="KV entries per page")
    cache.add_argument("--kv-pages", type=int, default=CacheConfig.kv_pages, metavar="N",
                       help="KV pages in the pool; a request is admitted when the pages its prompt and max_tokens "
                            "can reach are free (None: enough for --max-running requests of --max-context tokens)")
    cache.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                       metavar="FRACTION", help="CUDA: a page pool that fills the device's memory up to this "
                                                "fraction of its total, less the activations of the widest rounds and "
                                                "prefill step, measured at start-up (used when --kv-pages is not given)")
    _on_off(cache, "prefix_caching", CacheConfig.prefix_caching,
            "reuse the KV pages of prompt prefixes seen before (a shared system prompt is prefilled once; on in serve)")

    scheduler = parser.add_argument_group("scheduling (SchedulerConfig)")
    scheduler.add_argument("--max-running", "--max-num-seqs", type=int, default=SchedulerConfig.max_running,
                           help="requests decoded together")
    scheduler.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting,
                           help="queued requests before new ones are refused (HTTP 429)")
    scheduler.add_argument("--prefill-chunk", type=int, default=SchedulerConfig.prefill_chunk,
                           help="prompt tokens per request per step")
    scheduler.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", type=int,
                           default=SchedulerConfig.max_prefill_tokens,
                           help="padded prompt tokens per step over all prefilling requests (at least one chunk runs; "
                                "None: 256 on a CPU, 2048 on CUDA)")
    scheduler.add_argument("--max-round-tokens", type=int, default=SchedulerConfig.max_round_tokens, metavar="N",
                           help="tokens one decode round may verify over all its rows (rows rounded up to a power of "
                                "two, x (nodes + 1)): a larger round verifies a smaller tree of the budget's ladder, a "
                                "chain a plain round; also bounds the activations --gpu-memory-utilization reserves "
                                "(None: no bound for a fixed --budget; the adaptive policy's own: 128 on a CPU, "
                                "--cuda-graph-max-tokens on CUDA)")
    _on_off(scheduler, "queue_plain_rounds", SchedulerConfig.queue_plain_rounds,
            "queue the next plain round on the device before reading this one's results, so the host's work "
            "between rounds overlaps the device's (same tokens; None: on CUDA)")
    _on_off(scheduler, "incremental_text", SchedulerConfig.incremental_text,
            "keep each request's text current every step (streaming); off: decode it once at the end")
    scheduler.add_argument("--grammar-backend", "--guided-decoding-backend", choices=GRAMMAR_BACKENDS,
                           default=SchedulerConfig.grammar_backend,
                           help="the grammar engine that follows requests with structured output")

    kernels = parser.add_argument_group("kernels (KernelConfig)")
    _on_off(kernels, "quant_kernels", KernelConfig.quant_kernels,
            "CPU fp32 GGUF models: every product straight from the GGUF blocks, no fp32 copies (AVX-512 / AVX2 kernel); "
            "other float32 CPU products through the same kernel over their weights, so that a row's result never "
            "depends on the rows beside it (speculation gives plain decoding's bits); off: F.linear")
    _on_off(kernels, "int8_activations", KernelConfig.int8_activations,
            "with --quant-kernels: round each row of activations to int8 per 32 values (as llama.cpp does) and take "
            "integer block dot products (faster); off: float activations, the products of the fp32 weights")
    _on_off(kernels, "gpu_kernels", KernelConfig.gpu_kernels,
            "CUDA: norms, rotary and KV writes as fused Triton kernels (when Triton is installed)")
    _on_off(kernels, "cpu_kernels", KernelConfig.cpu_kernels,
            "CPU: norms, rotary, KV writes and short attention as fused C++ kernels (AVX-512 / AVX2)")
    _on_off(kernels, "cpu_layer_stack", KernelConfig.cpu_layer_stack,
            "CPU GGUF models: every decoder layer of a decode step or small tree in one C++ call (same values)")
    _on_off(kernels, "triton_attention", KernelConfig.triton_attention,
            "CUDA: attention with the Triton kernel that reads the KV pages through the block tables (no gather; "
            "one CUDA graph for every context length) instead of SDPA; None: in decode rounds and prompt chunks of up to 64 "
            "tokens a row, longer chunks keep SDPA")
    _on_off(kernels, "triton_tree", KernelConfig.triton_tree,
            "CUDA: DDTree tree work (kept lists, node selection, accept walk, KV commit) in Triton kernels (same trees)")
    _on_off(kernels, "cuda_graphs", KernelConfig.cuda_graphs, "CUDA: replay decode rounds as CUDA graphs")
    kernels.add_argument("--cuda-graph-max-tokens", type=_graph_tokens, default=KernelConfig.cuda_graph_max_tokens,
                         metavar="N", help="CUDA: capture at start-up the graphs of every round of up to N tokens "
                         "(rows x (nodes + 1)); none are captured while serving and larger rounds run eagerly; "
                         "'lazy': capture each graph when first needed, while serving")
    _on_off(kernels, "plain_fast_path", KernelConfig.plain_fast_path,
            "plain rounds skip the root-only tree and its accept walk (same tokens)")
    _on_off(kernels, "packed_verify", KernelConfig.packed_verify,
            "drafted tree rounds verify the rows' real tokens packed into one flat batch (the products run over "
            "those tokens only; same tokens): on, every device, a round of n nodes per row verifies rows x (n + 1) "
            "tokens, the rows' best nodes from trees of up to 4n (CUDA graphs keyed by the total); off, padded to the "
            "widest row; None: on a CPU the rows' budgets follow the measured cost curve, packed, CUDA padded")
    _on_off(kernels, "feature_sink", KernelConfig.feature_sink,
            "a plain round's drafter features are written by the fused norm kernel (same tokens)")
    _on_off(kernels, "planless_prefill", KernelConfig.planless_prefill,
            "CUDA: prefill attention with kernels that build no per-shape plan (same tokens)")
    _on_off(kernels, "warm_up", KernelConfig.warm_up,
            "start-up runs throwaway prefill steps of the widths first requests bring, so their kernels are "
            "compiled before serving; None: on CUDA")
    _on_off(kernels, "exact", KernelConfig.exact,
            "CUDA: the target's forwards with shape-invariant kernels: speculative tokens equal plain ones bit "
            "for bit in bf16, and a request's tokens do not depend on what else is in the batch")
    kernels.add_argument("--profile-stages", action="store_true", default=KernelConfig.profile_stages,
                         help="exact per-stage times: synchronizes the device around stages, so rounds run "
                              "eagerly (no CUDA graphs); a profiling mode, not for serving")

    parallel = parser.add_argument_group("tensor parallelism (ParallelConfig)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=ParallelConfig.tensor_parallel_size,
                          metavar="N", help="split the target's heads, MLP width and vocabulary over N processes, one "
                                            "per device (cuda:0 .. cuda:N-1, or N CPU processes); the engine starts them")
    parallel.add_argument("--worker-timeout", dest="worker_timeout_s", type=float,
                          default=ParallelConfig.worker_timeout_s, metavar="SECONDS",
                          help="a collective that waits this long for a tensor-parallel worker fails the engine")
    parallel.add_argument("--distributed-executor", choices=DISTRIBUTED_EXECUTORS,
                          default=ParallelConfig.distributed_executor,
                          help="who starts the tensor-parallel workers: mp (processes on this machine) or ray (actors "
                               "in a placement group on the Ray cluster at $RAY_ADDRESS or 'auto', else a local one; "
                               "pip install 'flashtree[ray]')")

    trace = parser.add_argument_group("traces (TraceConfig): they observe and never change what runs")
    trace.add_argument("--trace-trees", default=TraceConfig.trees, metavar="FILE",
                       help="write each round's trees and accepted paths as JSON lines")
    trace.add_argument("--trace-policy", default=TraceConfig.policy, metavar="FILE",
                       help="write each round's adaptive-speculation choice, time and estimates as JSON lines")
    trace.add_argument("--trace-steps", default=TraceConfig.steps, metavar="FILE",
                       help="write each engine step's round, prefill and the gap before it (ms) as JSON lines")
    trace.add_argument("--recent-trees", type=int, default=TraceConfig.recent_trees, metavar="N",
                       help="keep each request's last N draft trees in memory (serve's playground draws them; "
                            "serve's default: 4)")


# flag dest -> flat engine setting (EngineConfig.of); the speculation method and drafter go apart
ENGINE_FLAGS = ("model", "device", "dtype", "random_weights", "seed", "adaptive_spec", "policy_cache", "max_context",
                "page_size", "kv_pages", "gpu_memory_utilization", "prefix_caching", "max_running",
                "max_waiting", "prefill_chunk", "max_prefill_tokens", "max_round_tokens", "queue_plain_rounds", "incremental_text",
                "grammar_backend", *(f.name for f in dataclasses.fields(KernelConfig)), "trace_trees", "trace_policy", "trace_steps",
                "recent_trees", "tensor_parallel_size", "worker_timeout_s", "distributed_executor")


def speculation_from_args(args: argparse.Namespace) -> SpeculationConfig:
    """The method, drafter and budget asked for (a drafter implies ddtree; the embedded default model
    runs ddtree with its shipped drafter)."""
    from flashtree.speculative.defaults import default_spec

    method, draft = default_spec(args.model, args.spec, args.draft)
    return SpeculationConfig(method=method, draft=draft, budget=args.budget, block_size=args.block_size,
                             draft_vocab=args.draft_vocab)


def engine_config_from_args(args: argparse.Namespace, spec: SpeculationConfig | None = None,
                            **overrides) -> EngineConfig:
    """The engine config the flags describe (``spec``: a speculation config made otherwise;
    ``overrides``: flat settings a subcommand derives from its own flags)."""
    flat = {name: getattr(args, name) for name in ENGINE_FLAGS}
    return EngineConfig.of(spec=spec or speculation_from_args(args), **{**flat, **overrides})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    sampling = parser.add_argument_group("sampling (SamplingParams)")
    sampling.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    sampling.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                          help="sampling seed (None: a random one per request)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    shape = sampling.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE_OR_JSON", default=None,
                       help="structured output: answers follow this JSON schema (a file, or the schema itself)")
    shape.add_argument("--json-object", action="store_true", help="structured output: answers are a JSON object")
    shape.add_argument("--regex", default=None, help="structured output: answers match this regular expression")
    shape.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="structured output: the answer is one of these (repeatable)")
    shape.add_argument("--grammar", metavar="FILE_OR_TEXT", default=None,
                       help="structured output: answers follow this EBNF grammar (xgrammar's GBNF dialect; Lark with "
                            "--grammar-backend llguidance)")


def sampling_from_args(args):
    from flashtree.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.sampling_seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos, structured=structured_from_args(args))


def structured_from_args(args):
    """The structured output the flags ask for (None: free text)."""
    from flashtree.structured import StructuredOutput

    if args.json_schema is not None:
        return StructuredOutput("json", _file_or_text(args.json_schema, "--json-schema"))
    if args.json_object:
        return StructuredOutput("json_object")
    if args.regex is not None:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput("choice", tuple(args.choice))
    if args.grammar is not None:
        return StructuredOutput("grammar", _file_or_text(args.grammar, "--grammar"))
    return None


def _file_or_text(value: str, flag: str) -> str:
    """The file's text when ``value`` names a file, else ``value`` itself."""
    from pathlib import Path

    from flashtree.errors import ConfigError

    path = Path(value)
    if len(value) < 4096 and "\n" not in value and path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{flag}: cannot read {value}: {err}") from None
    return value


def llm_from_args(args, **overrides):
    from flashtree.llm import LLM

    return LLM(config=engine_config_from_args(args, **overrides))
