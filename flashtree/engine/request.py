"""A generation request and its per-request statistics.

Glossary
- prompt_ids: the tokens given by the user (chat template already applied).
- output_ids: generated tokens emitted so far (never past a stop condition).
- bonus token: the newest output token, chosen by the target but not yet run through it;
  it is ``output_ids[-1]`` while the request runs.
- committed length: prompt + output tokens whose K/V are in the target cache
  (= len(prompt_ids) + len(output_ids) - 1 once decoding started).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import Counter
from typing import Any

from flashtree.grammar.backends import GrammarMatcher
from flashtree.sampling import SamplingParams, TokenLogprob

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestStats:
    rounds: int = 0
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)
    tree_sizes: list[int] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))


@dataclasses.dataclass
class DecodeState:
    """Incremental detokenization of a request's output (the offsets scheme TGI and vLLM use).

    ``text`` is the decoded text of ``output_ids[:read_offset]``. New tokens are decoded in a
    window that starts ``prefix_offset`` tokens in (just before the last decoded piece), and the
    decode of ``output_ids[prefix_offset:read_offset]`` is cut off its front: whatever the
    tokenizer does at a window's start (a dropped leading space, merged bytes) happens in both
    decodes and cancels out. Each step then costs a few tokens of decoding instead of the whole
    output. ``exact_only``: this tokenizer's windows did not line up once; decode everything.

    With a Rust tokenizer that decodes as the fast decoder does, ``stream`` (the tokenizers
    library's ``DecodeStream``, the same windows in Rust) takes ``output_ids[read_offset:]`` a token
    at a time and returns the new text, or nothing while it ends in an incomplete character.
    """

    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    exact_only: bool = False
    stream: Any = None  # tokenizers.decoders.DecodeStream (not picklable: a request never leaves its process)


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # eos + end-of-turn + params.stop_token_ids
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the cache (chunked prefill)
    cached_tokens: int = 0  # prompt tokens whose KV pages came from the prefix cache
    prompt_unregistered: bool = False  # the drafter deferred the prompt: its pages join the prefix cache at the catch-up
    drafter_lag: int = 0  # tokens whose drafter features are deferred (read and written by DrafterLag only)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when params.logprobs is set
    text: str = ""
    decoded: DecodeState = dataclasses.field(default_factory=DecodeState)  # see TextTracker
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stopped_by: str | int | None = None  # the stop string or stop token id that finished it (reason "stop")
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    budget: int | None = None  # per-request DDTree budget (None: the method's default)
    recent_trees: list[dict] | None = dataclasses.field(default=None, repr=False)  # its last draft trees, when
    # it keeps them (engine/traces.py RecentTrees)
    grammar: GrammarMatcher | None = dataclasses.field(default=None, repr=False)  # with structured output: at
    # the state after every output token so far (engine/constraint.py)
    after: "Request | None" = dataclasses.field(default=None, repr=False)  # admitted only once this one's
    # prompt is in (a sibling of the same prompt, which then maps its cached pages instead of prefilling them)

    @property
    def committed_length(self) -> int:
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
