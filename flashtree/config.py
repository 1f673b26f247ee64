"""The engine's configuration: one small frozen config per concern, each validated when it is made.

``EngineConfig`` groups them:

| config | concern |
| --- | --- |
| :class:`TargetConfig` | which target model, on which device, in which dtype |
| :class:`SpeculationConfig` | the decoding method, its drafter and budget, the adaptive policy |
| :class:`CacheConfig` | the KV cache: how many tokens a request may hold |
| :class:`SchedulerConfig` | continuous batching: running and waiting requests, prefill chunks, queued rounds, grammars |
| :class:`KernelConfig` | which kernels and execution paths run (each one can be switched off to compare) |
| :class:`TraceConfig` | trace files; tracing observes and never changes what runs |
| :class:`ParallelConfig` | tensor parallelism: how many processes (one per device) hold the target's shards |

Every field has a command-line flag of the same meaning (``flashtree generate --help`` lists them
with their defaults). :meth:`EngineConfig.of` builds a config from flat keyword arguments (the
field names, ``LLM(model, max_running=16, gpu_kernels=False)``).
"""

from __future__ import annotations

import dataclasses

from flashtree.errors import ConfigError

SPEC_METHODS = ("none", "dflash", "ddtree")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")  # flashtree/grammar/backends.py


def _check_positive_ints(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _check_bools(config, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(config, name)!r}")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    model: str = "smollm2"  # HF directory, hub id, .gguf file, or "smollm2" (the embedded default)
    device: str | None = None  # None / "auto": CUDA when available
    dtype: str | None = None  # None / "auto": bf16 on CUDA, fp32 on CPU
    random_weights: bool = False  # weights drawn from the config (speed runs at real sizes)
    seed: int = 0  # random-weight initialization (the drafter's uses seed + 1)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty string, got {self.model!r}")
        _check_bools(self, "random_weights")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the adaptive speculation policy (``flashtree.policy.adaptive``)."""

    smoothing: float = 0.2  # EMA weight of the newest round time (the first ones are averaged)
    acceptance_smoothing: float = 0.05  # the same per row for acceptance lengths (a noisy small integer)
    explore_rounds: int = 2  # timed rounds of every option per rows bucket before trusting estimates
    probe_interval: int = 50  # rounds of a bucket between tries of a neighbour of the best option
    max_probe_interval: int = 800  # the interval doubles after each probe that changes nothing, up to this
    # (or to what probe_cost_share needs, if more)
    min_tree_nodes: int = 4  # smallest non-zero tree in a DDTree ladder (halving stops above it)
    probe_rounds: int = 4  # rows x rounds of a probe (consecutive rounds, averaged into one measurement)
    plain_recheck_interval: int = 200  # rounds of a bucket on trees after which plain is re-measured
    settled_batch: int = 8  # settled rounds (the best option, nothing due) folded into the estimates at a time
    probe_cost_share: float | None = 0.001  # most of a bucket's time a probe that changes nothing may cost
    # (its interval is stretched past max_probe_interval to keep it so; None: no such floor)
    max_round_tokens: int | None = None  # a rows bucket's tree options verify at most this many tokens
    # (bucket rows x (nodes + 1)); larger ones are never tried there. None: by device (round_tokens_for)

    def __post_init__(self) -> None:
        for name in ("smoothing", "acceptance_smoothing"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        _check_positive_ints(self, "explore_rounds", "probe_interval", "max_probe_interval", "min_tree_nodes",
                             "probe_rounds", "plain_recheck_interval", "settled_batch")
        if self.probe_cost_share is not None and not 0.0 < self.probe_cost_share <= 1.0:
            raise ConfigError(f"probe_cost_share must be in (0, 1] or None, got {self.probe_cost_share!r}")
        if self.max_probe_interval < self.probe_interval:
            raise ConfigError(f"max_probe_interval ({self.max_probe_interval}) must be >= probe_interval "
                              f"({self.probe_interval})")
        if self.max_round_tokens is not None:
            _check_positive_ints(self, "max_round_tokens")


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    method: str = "none"  # none | dflash | ddtree
    draft: str | None = None  # drafter checkpoint (directory or hub id)
    budget: int | None = None  # DDTree node budget (None: the default for the device)
    block_size: int | None = None  # lower the drafter's block size (never raise it)
    draft_vocab: int | None = None  # draft from the drafter's N most frequent tokens only
    # (speculative/draft_vocab.py); 0: the whole vocabulary; None: the device's default
    adaptive: bool = True  # pick each round's node count (0 = plain) for throughput; False: always the budget
    policy: PolicyConfig = PolicyConfig()  # knobs of the adaptive policy
    policy_cache: bool = True  # the adaptive policy starts from what the last process of the same setup
    # learned and keeps what it learns, under the user's cache directory (policy/memory.py)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"--spec {self.method!r} is not a decoding method; allowed: {', '.join(SPEC_METHODS)}")
        if self.method != "none" and not self.draft:
            raise ConfigError(f"--spec {self.method} needs a drafter: pass --draft PATH")
        if self.budget is not None and not (isinstance(self.budget, int) and 0 <= self.budget <= 4096):
            raise ConfigError(f"--budget must be an integer in [0, 4096], got {self.budget!r}")
        if self.block_size is not None and not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ConfigError(f"--block-size must be an integer >= 2, got {self.block_size!r}")
        if self.draft_vocab is not None:
            if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
                raise ConfigError(f"--draft-vocab must be an integer >= 0 (0: the whole vocabulary), "
                                  f"got {self.draft_vocab!r}")
            if self.method == "none" and self.draft_vocab:
                raise ConfigError("--draft-vocab needs a drafter (--spec dflash or ddtree)")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive_spec must be True or False, got {self.adaptive!r}")
        _check_bools(self, "policy_cache")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    max_context: int = 2048  # prompt + output tokens per request
    page_size: int = 16  # KV entries per page
    kv_pages: int | None = None  # pages in the pool (None: every running request can reach max_context)
    prefix_caching: bool = False  # reuse the KV pages of prompt prefixes seen before (kv/prefix_cache.py)
    gpu_memory_utilization: float | None = None  # CUDA: size the page pool so the device's memory in use
    # reaches this fraction of its total with the widest work's activations (engine/memory_profile.py) left free
    # (when kv_pages is None; None: every running request can reach max_context)

    def __post_init__(self) -> None:
        _check_positive_ints(self, "max_context", "page_size")
        if self.kv_pages is not None and not (isinstance(self.kv_pages, int) and self.kv_pages >= 1):
            raise ConfigError(f"kv_pages must be an integer >= 1 or None, got {self.kv_pages!r}")
        _check_bools(self, "prefix_caching")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not (isinstance(utilization, float | int) and 0 < utilization <= 1):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1] or None, got {utilization!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 8  # requests decoded together (KV slots)
    max_waiting: int = 256  # queued requests before the server answers 429
    prefill_chunk: int = 512  # prompt tokens per request per step
    max_prefill_tokens: int | None = None  # padded prompt tokens per step, all requests together (>= 1 chunk
    # runs); None: by device (prefill_tokens_for): a CPU step keeps the running streams waiting for all of it
    queue_plain_rounds: bool | None = None  # queue the next plain round before reading this one's
    # results (engine/overlap.py); None: where the device runs ahead of the host (CUDA)
    incremental_text: bool = True  # keep each request's text current every step (streaming); False:
    # decode it once when the request finishes (batch jobs: regenerate, bench), unless it has stop strings
    grammar_backend: str = "xgrammar"  # what follows requests with structured output: xgrammar | llguidance
    max_round_tokens: int | None = None  # tokens one decode round may verify, all rows together (its rows bucket
    # x (nodes + 1)): a round over it verifies the largest smaller option of the policy's ladder that fits (a
    # smaller tree; a chain: plain), as vLLM trims speculative tokens to max_num_batched_tokens; bounds the
    # activation reserve too. None: none for a fixed budget; the adaptive policy keeps its own (PolicyConfig)

    def __post_init__(self) -> None:
        _check_positive_ints(self, "max_running", "max_waiting", "prefill_chunk")
        if self.max_prefill_tokens is not None:
            _check_positive_ints(self, "max_prefill_tokens")
        if self.max_round_tokens is not None:
            _check_positive_ints(self, "max_round_tokens")
            if self.max_round_tokens < self.max_running:
                raise ConfigError(f"max_round_tokens ({self.max_round_tokens}) must be at least max_running "
                                  f"({self.max_running}): a plain round verifies one token a row")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ConfigError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {self.grammar_backend!r}")
        if self.queue_plain_rounds not in (None, True, False):
            raise ConfigError(f"queue_plain_rounds must be True, False or None (auto), got {self.queue_plain_rounds!r}")
        _check_bools(self, "incremental_text")


# max_prefill_tokens by device: on a 2-core EPYC SmolLM2 prefills about 1.4 ms per padded token beside
# a 64-row decode round of about 0.2 s; with 64 streaming clients (benchmarks/soak_test.py) 2,048 made
# steps of up to 2 s and 512 of up to 1.1 s (streams stalled while arrivals prefilled), 256 kept every
# gap under 1 s at the same throughput. On an H200 2,048 tokens are below the ridge.
PREFILL_TOKENS_BY_DEVICE = {"cpu": 256, "cuda": 2048}


# PolicyConfig.max_round_tokens by device: a 2-core CPU is compute-bound well below a hundred tokens per
# forward, so a round of more tokens costs about its token count in plain steps and a tree cannot pay
# there (DDTree 0.96-0.98x plain at 32 rows, benchmarks/README.md), while its probes stall every stream
# for up to a second (benchmarks/soak_test.py at 64 rows); on CUDA the cap is KernelConfig.cuda_graph_max_tokens
# (rounds past it have no CUDA graph), or none without graphs.
ROUND_TOKENS_BY_DEVICE = {"cpu": 128, "cuda": None}


def _by_device(value, defaults: dict, device_type: str):
    """``value``, or when it is None the default for ``device_type`` (CUDA's for other devices)."""
    return value if value is not None else defaults.get(device_type, defaults["cuda"])


def round_tokens_for(config: PolicyConfig, device_type: str) -> int | None:
    return _by_device(config.max_round_tokens, ROUND_TOKENS_BY_DEVICE, device_type)


def prefill_tokens_for(config: SchedulerConfig, device_type: str) -> int:
    return _by_device(config.max_prefill_tokens, PREFILL_TOKENS_BY_DEVICE, device_type)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    quant_kernels: bool = True  # CPU fp32 GGUF models: every product straight from the GGUF blocks (no fp32 copies);
    # the other float32 CPU products through the same kernel over their weights (row-invariant, unlike F.linear)
    int8_activations: bool = True  # with quant_kernels: each row of x rounded to int8 per 32 values (as llama.cpp
    # does) and integer block dot products; False: float x (bit-comparable with the fp32 weights' products)
    gpu_kernels: bool = True  # CUDA with Triton: fused kernels for norms, rotary, KV writes (kernels/gpu/)
    cpu_kernels: bool = True  # CPU fp32: the same small ops fused in C++ (kernels/cpu/; AVX-512 or AVX2)
    cpu_layer_stack: bool = True  # with cpu_kernels and GGUF blocks: every decoder layer of a forward of
    # <= 32 tokens in one C++ call (same values as layer by layer)
    triton_attention: bool | None = None  # with gpu_kernels: the Triton paged attention (reads K/V through
    # the block tables: no gather, one graph for every context length) instead of SDPA over gathered pages;
    # None: in decode forwards (plain steps, chains, trees, drafter blocks) and prompt chunks of up to 64 tokens
    # a row (models/transformer.py SHORT_PREFILL_TOKENS), longer chunks keep SDPA; True: in every forward; False: never
    triton_tree: bool = True  # with gpu_kernels: DDTree tree work in Triton kernels (same trees, walks, cache)
    cuda_graphs: bool = True  # replay decode rounds as CUDA graphs (CUDA only)
    # the graphs of rounds of up to this many tokens (rows x (nodes + 1)) are captured at start-up and
    # none while serving (larger rounds, and those with log-probabilities or adjusted logits, run eagerly;
    # the adaptive policy never chooses a larger one); None: captured when first needed, while serving
    cuda_graph_max_tokens: int | None = 4096
    plain_fast_path: bool = True  # plain rounds skip the root-only tree and its accept walk (same values)
    # the verify forward's layout for drafted tree rounds (models/packing.py: packed, the products run over the
    # rows' real tokens only; same tokens every way; a tensor-parallel forward stays padded). None: on a CPU the
    # rows' budgets follow the policy's measured cost curve and verify packed; on CUDA every row verifies the
    # round's node count, padded. True, on every device: a round of n nodes per row verifies rows x (n + 1) tokens
    # packed, the rows' best nodes from trees of up to 4n each (fixed sizes: CUDA graphs keyed by the total).
    # False: padded everywhere (on a CPU narrowed to the widest row)
    packed_verify: bool | None = None
    feature_sink: bool = True  # a plain round's drafter features are written by the fused norm, not copied after
    planless_prefill: bool = True  # CUDA prefill attention with kernels that build no per-shape plan
    # start-up runs throwaway prefill steps of the widths and row counts first requests bring, so that the
    # kernels they need are compiled before serving (engine/warm_up.py); None: on CUDA (Triton compiles there)
    warm_up: bool | None = None
    # CUDA: the target's forwards (prefill, plain steps, chains, trees) with shape-invariant kernels
    # (kernels/gpu/exact.py): speculative tokens equal plain ones bit for bit in bf16 / fp16, and a
    # request's tokens do not depend on the batch it shares (issue #29)
    exact: bool = False
    profile_stages: bool = False  # time each stage of a round exactly: synchronizes the device around
    # stages, so rounds run eagerly (no CUDA graphs); a profiling mode, not for serving

    def __post_init__(self) -> None:
        _check_bools(self, *(f.name for f in dataclasses.fields(self)
                             if f.name not in ("triton_attention", "cuda_graph_max_tokens", "packed_verify", "warm_up")))
        if self.cuda_graph_max_tokens is not None:
            _check_positive_ints(self, "cuda_graph_max_tokens")
        if self.triton_attention not in (None, True, False):
            raise ConfigError(f"triton_attention must be True, False or None (None: decode forwards only), "
                              f"got {self.triton_attention!r}")
        if self.packed_verify not in (None, True, False):
            raise ConfigError(f"packed_verify must be True, False or None (None: packed on a CPU only), "
                              f"got {self.packed_verify!r}")
        if self.warm_up not in (None, True, False):
            raise ConfigError(f"warm_up must be True, False or None (None: on CUDA), got {self.warm_up!r}")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    trees: str | None = None  # JSON lines: per round, each request's tree and accepted path
    policy: str | None = None  # JSON lines: per round, the adaptive policy's choice, timing, estimates
    steps: str | None = None  # JSON lines: per engine step, its round, prefill and the gap before it (ms)
    recent_trees: int = 0  # keep each request's last N draft trees in memory (the playground draws them)

    def __post_init__(self) -> None:
        if isinstance(self.recent_trees, bool) or not isinstance(self.recent_trees, int) or self.recent_trees < 0:
            raise ConfigError(f"recent_trees must be an integer >= 0, got {self.recent_trees!r}")


DISTRIBUTED_EXECUTORS = ("mp", "ray")  # who starts tensor-parallel workers (ParallelConfig.distributed_executor)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # processes (one per device) that each hold 1/N of the target's heads,
    # MLP width and vocabulary (engine/tp_executor.py); 1: one process, no collectives
    worker_timeout_s: float = 600.0  # a collective that waits this long for a tensor-parallel worker fails
    distributed_executor: str = "mp"  # who starts the workers: "mp" (processes here) or "ray" (actors on a Ray cluster)

    def __post_init__(self) -> None:
        _check_positive_ints(self, "tensor_parallel_size")
        if self.distributed_executor not in DISTRIBUTED_EXECUTORS:
            raise ConfigError(f"distributed_executor must be one of {', '.join(DISTRIBUTED_EXECUTORS)}, "
                              f"got {self.distributed_executor!r}")
        timeout = self.worker_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, float | int) or timeout <= 0:
            raise ConfigError(f"worker_timeout_s must be a number of seconds > 0, got {timeout!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    target: TargetConfig = TargetConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kernels: KernelConfig = KernelConfig()
    trace: TraceConfig = TraceConfig()
    parallel: ParallelConfig = ParallelConfig()

    @classmethod
    def of(cls, spec: SpeculationConfig | None = None, **flat) -> "EngineConfig":
        """A config from flat keyword arguments: the sections' field names (``max_running=16``,
        ``gpu_kernels=False``), and ``spec`` for the whole :class:`SpeculationConfig`."""
        sections: dict[str, dict] = {}
        for name, value in flat.items():
            if name not in FLAT_FIELDS:
                raise ConfigError(f"{name!r} is not an engine setting; allowed: {', '.join(sorted(FLAT_FIELDS))}")
            section, field = FLAT_FIELDS[name]
            sections.setdefault(section, {})[field] = value
        speculation = dataclasses.replace(spec or SpeculationConfig(), **sections.pop("speculation", {}))
        made = {name: SECTIONS[name](**fields) for name, fields in sections.items()}
        return cls(speculation=speculation, **made)


SECTIONS = {"target": TargetConfig, "speculation": SpeculationConfig, "cache": CacheConfig,
            "scheduler": SchedulerConfig, "kernels": KernelConfig, "trace": TraceConfig, "parallel": ParallelConfig}
# flat keyword -> (section, field); the flat name is the field's, except where a prefix says what it is
_RENAMED = {("speculation", "adaptive"): "adaptive_spec", ("speculation", "policy"): "spec_policy",
            ("trace", "trees"): "trace_trees", ("trace", "policy"): "trace_policy", ("trace", "steps"): "trace_steps"}
FLAT_FIELDS = {_RENAMED.get((section, f.name), f.name): (section, f.name)
               for section, config in SECTIONS.items() for f in dataclasses.fields(config)
               if (section, f.name) not in {("speculation", n) for n in ("method", "draft", "budget", "block_size",
                                                                         "draft_vocab")}}
