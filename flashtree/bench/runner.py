"""Run every benchmark method over the same prompts in one process, loading the target once.

Plain decoding runs first and is the reference. Each method gets its own engine (an engine has
one proposer and its own KV cache) built over the one shared target; engines are built just
before their run and dropped after it, so only one KV cache is alive at a time. Each engine
first decodes a short warm-up request that is not timed.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from typing import NamedTuple, Sequence

import torch

from flashtree.bench import llamacpp
from flashtree.bench.methods import BenchMethod
from flashtree.config import EngineConfig
from flashtree.engine.engine import LLMEngine
from flashtree.engine.request import Request
from flashtree.models.build import LoadedTarget, load_target, resolve_device, resolve_dtype
from flashtree.models.tokenizer import stop_token_ids_for
from flashtree.sampling import SamplingParams

SEED_BASE = 1234  # prompt i samples with seed SEED_BASE + i under every method


@dataclasses.dataclass(frozen=True)
class BenchSetup:
    """What every method of a benchmark shares: the engine but for its decoding method, and what it generates."""

    engine: EngineConfig  # its speculation gives the drafter, block size, draft vocabulary and adaptive policy
    max_new_tokens: int
    temperature: float
    ignore_eos: bool = False
    warmup_tokens: int = 16  # tokens of each untimed warm-up request, one per row of the first batch (0: none)

    @property
    def batch_size(self) -> int:
        return self.engine.scheduler.max_running

    def engine_config(self, method: BenchMethod) -> EngineConfig:
        return dataclasses.replace(self.engine, speculation=method.speculation(self.engine.speculation))

    def options(self) -> dict:
        """The settings a report records."""
        engine, spec = self.engine, self.engine.speculation
        return {"model": engine.target.model, "draft": spec.draft, "block_size": spec.block_size,
                "device": engine.target.device, "dtype": engine.target.dtype, "batch_size": self.batch_size,
                "max_context": engine.cache.max_context, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "ignore_eos": self.ignore_eos, "draft_vocab": spec.draft_vocab,
                "random_weights": engine.target.random_weights, "warmup_tokens": self.warmup_tokens,
                "adaptive_spec": spec.adaptive, **dataclasses.asdict(engine.kernels)}

    def sampling(self, prompt_index: int, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens or self.max_new_tokens,
                              seed=SEED_BASE + prompt_index, ignore_eos=self.ignore_eos)


class MethodRun(NamedTuple):
    """What one method produced over the prompts."""

    method: BenchMethod
    budget: int  # drafted nodes verified per round at most (0 for plain decoding)
    outputs: list[list[int]]  # generated token ids per prompt
    acceptance_lengths: list[int]  # every round of every prompt, bonus included
    tree_sizes: list[int]  # drafted nodes verified, every round of every prompt
    wall_seconds: float  # the timed generation, prefill included
    stage_seconds: dict[str, float]  # engine.timer.seconds over the timed generation
    graph_captures: int = 0  # CUDA graphs captured inside the timed generation (after the engine's start-up)
    eager_rounds: int = 0  # rounds run eagerly inside it for want of a start-up graph


def load_shared_target(config: EngineConfig) -> LoadedTarget:
    device = resolve_device(config.target.device)
    return load_target(config, device, resolve_dtype(config.target.dtype, device))


def run_method(setup: BenchSetup, method: BenchMethod, target: LoadedTarget,
               prompt_ids: Sequence[list[int]], progress=None) -> MethodRun:
    if method.is_llamacpp:
        return run_llamacpp(setup, method, target, prompt_ids, progress)
    engine = LLMEngine(setup.engine_config(method), target=target)
    try:
        if setup.warmup_tokens > 0:  # a full first batch: its prefill shapes (and their one-time
            # kernel compiles) are then paid here, not by whichever method is timed first
            first = prompt_ids[:setup.batch_size]
            generate(engine, first, [setup.sampling(i, setup.warmup_tokens) for i in range(len(first))])
            engine.timer.seconds.clear()
        if progress is not None:
            progress.reset()  # the warm-up is not part of the timed run
        params = [setup.sampling(i) for i in range(len(prompt_ids))]
        captures, eager = engine.graph_counts
        start = time.perf_counter()
        requests = generate(engine, prompt_ids, params, progress)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        wall = time.perf_counter() - start
        captures_after, eager_after = engine.graph_counts
        return MethodRun(method, engine.proposer.max_nodes, [list(r.output_ids) for r in requests],
                         [n for r in requests for n in r.stats.acceptance_lengths],
                         [n for r in requests for n in r.stats.tree_sizes], wall, dict(engine.timer.seconds),
                         captures_after - captures, eager_after - eager)
    finally:
        del engine
        release_memory()


def run_llamacpp(setup: BenchSetup, method: BenchMethod, target: LoadedTarget,
                 prompt_ids: Sequence[list[int]], progress=None) -> MethodRun:
    """llama.cpp over the same prompt ids (``bench/llamacpp.py``): one round per token."""
    stop_ids = frozenset() if setup.ignore_eos else frozenset(stop_token_ids_for(target.model.config, target.tokenizer))
    outputs, seconds = llamacpp.generate(setup.engine.target.model, prompt_ids, setup.max_new_tokens, stop_ids,
                                         setup.engine.cache.max_context)
    if progress is not None:
        progress.update(len(prompt_ids))
    ones = [1 for tokens in outputs for _ in tokens]
    return MethodRun(method, 0, outputs, ones, [0] * len(ones), seconds, {})


def generate(engine: LLMEngine, prompt_ids: Sequence[list[int]], params: Sequence[SamplingParams],
             progress=None) -> list[Request]:
    """Decode every prompt to the end; ``progress`` (a tqdm bar: ``update``, ``reset``) advances
    per finished prompt."""
    pending = deque(zip(prompt_ids, params))
    requests: list[Request] = []
    while pending or any(not r.finished for r in requests):
        while pending and len(engine.scheduler.waiting) < engine.config.scheduler.max_waiting:
            requests.append(engine.add_request(*pending.popleft()))
        finished = sum(event.finished for event in engine.step())
        if progress is not None and finished:
            progress.update(finished)
    return requests


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
