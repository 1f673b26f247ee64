"""The Python API: ``flashtree.LLM(model=...).generate(prompts, params)``, ``.chat(messages, params)``
and ``.stats()`` (per-run decoding statistics).

Glossary
- round: one draft -> verify -> accept step for a request; a batched round counts once per row.
- committed tokens: tokens a round commits, its bonus token included (= its acceptance length).
- acceptance length (tau): committed tokens per round; its mean is the speed-up bound.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

from flashtree.config import EngineConfig, SpeculationConfig
from flashtree.engine.engine import LLMEngine
from flashtree.engine.request import Request
from flashtree.models.tokenizer import encode_chat, encode_prompt
from flashtree.sampling import SamplingParams, TokenLogprob
from flashtree.speculative.defaults import default_spec


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str | None
    rounds: int
    acceptance_lengths: list[int]  # tokens committed per round (bonus included)
    tree_sizes: list[int]  # drafted nodes verified per round
    logprobs: list[TokenLogprob] | None = None  # per generated token, when SamplingParams.logprobs was set

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        return cls(req.request_id, list(req.prompt_ids), list(req.output_ids), req.text, req.finish_reason,
                   req.stats.rounds, list(req.stats.acceptance_lengths), list(req.stats.tree_sizes),
                   None if req.params.logprobs is None else list(req.output_logprobs))


@dataclasses.dataclass(frozen=True)
class RunStats:
    """Totals over the requests an :class:`LLM` finished since it was made (or last reset)."""

    requests: int
    rounds: int  # decode rounds, summed over requests
    generated_tokens: int  # output tokens (the first comes from the prefill, not a round)
    committed_tokens: int  # tokens committed by rounds = sum of acceptance lengths
    mean_acceptance_length: float  # tau = committed_tokens / rounds (0.0 without rounds)
    acceptance_histogram: dict[int, int]  # acceptance length -> rounds
    mean_tree_size: float  # drafted nodes verified per round
    stage_seconds: dict[str, float]  # wall time per engine stage (prefill, draft, verify, commit / round)
    # node count the engine chose -> batched rounds (one per step, not per row; 0: plain rounds)
    rounds_by_nodes: dict[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, outputs: Sequence["RequestOutput"], stage_seconds: dict[str, float],
           rounds_by_nodes: dict[int, int] | None = None) -> "RunStats":
        lengths = [n for out in outputs for n in out.acceptance_lengths]
        sizes = [n for out in outputs for n in out.tree_sizes]
        return cls(
            requests=len(outputs), rounds=len(lengths),
            generated_tokens=sum(len(out.token_ids) for out in outputs), committed_tokens=sum(lengths),
            mean_acceptance_length=sum(lengths) / len(lengths) if lengths else 0.0,
            acceptance_histogram=dict(sorted(Counter(lengths).items())),
            mean_tree_size=sum(sizes) / len(sizes) if sizes else 0.0, stage_seconds=dict(stage_seconds),
            rounds_by_nodes=dict(sorted((rounds_by_nodes or {}).items())))


class LLM:
    """Offline batched generation. Keyword arguments are engine settings (:meth:`EngineConfig.of`);
    ``spec``, ``draft``, ``budget``, ``block_size`` and ``draft_vocab`` build its :class:`SpeculationConfig`.
    ``config``: a whole :class:`EngineConfig` instead (then ``model`` and the keywords are not used)."""

    def __init__(self, model: str = "smollm2", *, spec: str = "none", draft: str | None = None,
                 budget: int | None = None, block_size: int | None = None, draft_vocab: int | None = None,
                 config: EngineConfig | None = None, **engine_kwargs):
        if config is None:
            spec, draft = default_spec(model, spec, draft)  # dflash/ddtree on smollm2: the shipped drafter
            spec_config = SpeculationConfig(method=spec, draft=draft, budget=budget, block_size=block_size,
                                            draft_vocab=draft_vocab)
            config = EngineConfig.of(model=model, spec=spec_config, **engine_kwargs)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._finished: list[RequestOutput] = []  # outputs since the last stats reset
        self._stage_base: dict[str, float] = {}  # timer readings at the last stats reset
        self._nodes_base: Counter[int] = Counter()  # engine.rounds_by_nodes at the last stats reset

    def stats(self, reset: bool = False) -> RunStats:
        """Decoding statistics of every request generated since this LLM was made or last
        reset; ``reset=True`` starts a new window after reading."""
        seconds, nodes = self.engine.timer.seconds, self.engine.rounds_by_nodes
        stats = RunStats.of(self._finished, {k: v - self._stage_base.get(k, 0.0) for k, v in seconds.items()},
                            nodes - self._nodes_base)
        if reset:
            self._finished, self._stage_base, self._nodes_base = [], dict(seconds), Counter(nodes)
        return stats

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings (tokenized without a chat template) or lists of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [encode_prompt(self.tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, params)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template is applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([encode_chat(self.tokenizer, conv) for conv in conversations], params)

    def _run(self, prompt_ids: list[list[int]], params) -> list[RequestOutput]:
        params = params or SamplingParams()
        per_prompt = [params] * len(prompt_ids) if isinstance(params, SamplingParams) else list(params)
        requests: list[Request] = []
        pending = list(zip(prompt_ids, per_prompt))
        while pending or any(not r.finished for r in requests):
            while pending and len(self.engine.scheduler.waiting) < self.engine.config.scheduler.max_waiting:
                ids, p = pending.pop(0)
                requests.append(self.engine.add_request(ids, p))
            self.engine.step()
        outputs = [RequestOutput.of(r) for r in requests]
        self._finished.extend(outputs)
        return outputs
