"""EngineConfig: everything that shapes an engine, validated once, frozen."""

from __future__ import annotations

import dataclasses

from flashtree.policy.adaptive import SpecPolicyConfig
from flashtree.errors import ConfigError

SPEC_METHODS = ("none", "dflash", "ddtree")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    method: str = "none"  # none | dflash | ddtree
    draft: str | None = None  # drafter checkpoint (directory or hub id)
    budget: int | None = None  # DDTree node budget (None: the default for the device)
    block_size: int | None = None  # lower the drafter's block size (never raise it)
    draft_vocab: int | None = None  # draft from the drafter's N most frequent tokens only (spec/draft_vocab.py);
    # 0: the whole vocabulary; None: the device's default (draft_vocab.default_size)

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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    spec: SpecConfig = SpecConfig()
    device: str | None = None  # None/auto: CUDA when available
    dtype: str | None = None  # None/auto: bf16 on CUDA, fp32 on CPU
    max_running: int = 8  # max requests decoded together (KV slots)
    max_context: int = 2048  # prompt + output tokens per request
    max_waiting: int = 256  # queued requests before the server answers 429
    prefill_chunk: int = 512  # prompt tokens per request per step
    max_prefill_tokens: int = 2048  # padded prompt tokens per step, all requests together (>= 1 chunk runs)
    random_weights: bool = False
    seed: int = 0  # random-weight init
    profile_stages: bool = False  # synchronize the device around stages for exact stage times
    cuda_graphs: bool = True  # replay decode rounds as CUDA graphs (CUDA only)
    trace_trees: str | None = None  # JSON-lines file: per round, each request's tree and accepted path
    trace_policy: str | None = None  # JSON-lines file: per round, the adaptive policy's choice, timing, estimates
    trace_steps: str | None = None  # JSON-lines file: per engine step, its round, prefill and the gap before it (ms)
    quant_kernels: bool = True  # CPU fp32 GGUF models: products of <= 32 rows straight from the GGUF blocks
    gpu_kernels: bool = True  # CUDA with Triton: fused kernels for norms, rotary, KV writes (models/gpu_kernels.py)
    cpu_kernels: bool = True  # CPU fp32: the same small ops fused in C++ (models/cpu_kernels.py; AVX-512 or AVX2 + compiler)
    triton_attention: bool = False  # with gpu_kernels: Triton tree attention instead of SDPA (one graph per
    # batch shape for every context length; reads K/V by slot, so scattered rows need no gather: 2.4x the
    # tokens/s of SDPA for regeneration at batch 512; slower than cuDNN for trees and small contiguous batches)
    triton_tree: bool = True  # with gpu_kernels: DDTree tree work in Triton kernels (drafter top-k, kept lists,
    # node selection, accept walk, KV commit; same trees, walks and cache; H200 build + walk at budget 256:
    # 1.74 ms of torch ops -> 0.19 ms, benchmarks/README.md)
    incremental_text: bool = True  # keep each request's text current every step (streaming); False:
    # decode it once when the request finishes (batch jobs: regenerate, bench), unless it has stop strings
    adaptive_spec: bool = True  # pick each round's node count (0 = plain) for throughput; False: always max
    queue_plain_rounds: bool | None = None  # queue the next plain round before reading this one's results
    # (engine.py, "Queued plain rounds"); None: where the device runs ahead of the host (CUDA)
    spec_policy: SpecPolicyConfig = SpecPolicyConfig()  # knobs of the adaptive policy

    def __post_init__(self) -> None:
        for name in ("max_running", "max_context", "max_waiting", "prefill_chunk", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.adaptive_spec, bool):
            raise ConfigError(f"adaptive_spec must be True or False, got {self.adaptive_spec!r}")
        if self.queue_plain_rounds not in (None, True, False):
            raise ConfigError(f"queue_plain_rounds must be True, False or None (auto), got {self.queue_plain_rounds!r}")
