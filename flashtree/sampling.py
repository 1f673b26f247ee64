"""SamplingParams and the device-side token chooser.

Randomness is keyed, not streamed: the Gumbel noise for a request's k-th generated token is a
hash of (seed, k, vocab id). So plain decoding and every speculative method draw the same noise
for the same output position, and a seeded request gives the same tokens whichever method runs
it (given the same target distribution). Along an accepted tree path every depth uses fresh,
independent noise, so the committed tokens are exact samples of the target's distribution.
No per-token host sync: everything here is tensor ops.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import NamedTuple, Sequence

import torch

from flashtree.errors import RequestError
from flashtree.structured import StructuredOutput

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest tokens'
    min_tokens: int = 0  # output tokens before a stop token may be chosen (and stop strings count)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    structured: StructuredOutput | None = None  # the output's required form (a schema, regex, ...: structured.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 2):
            raise RequestError(f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(f"structured must be a StructuredOutput or None, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """The target's logits are adjusted before its choice (``flashtree/penalties.py``)."""
        return (self.min_tokens > 0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (random when unset) so the request is reproducible."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(62))


def seed_value(params: SamplingParams) -> int:
    """The request's seed as a non-negative int64."""
    return (params.seed or 0) & ((1 << 63) - 1)


class SamplingTensors(NamedTuple):
    """Per-row sampling settings on the device."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    seed: torch.Tensor  # [B] int64
    any_sampled: bool  # host flag: skip the sampler when every row is greedy
    any_filtered: bool  # host flag: some row uses top-p / top-k

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> "SamplingTensors":
        seeds = [seed_value(p) for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            seed=torch.tensor(seeds, dtype=torch.long, device=device),
            any_sampled=any(not p.greedy for p in params),
            any_filtered=any(not p.greedy and (p.top_p < 1 or p.top_k > 0) for p in params),
        )


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_C1, _C2, _C3 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 (multiplication wraps modulo 2**64)."""
    x = (x ^ _shift_right(x, 30)) * _C2
    x = (x ^ _shift_right(x, 27)) * _C3
    return x ^ _shift_right(x, 31)


def keyed_uniform(seed: torch.Tensor, out_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0,1) noise ``[B, M, vocab]`` float32 from seed ``[B]`` and output index ``[B, M]``."""
    key = _mix(seed[:, None] * _C1 + out_index * _C2 + 0x632BE59BD9B4E019)  # [B, M]
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)  # [V]
    bits = _mix(key[:, :, None] + (ids + 1) * _C1)  # [B, M, V]
    return unit_interval(bits)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """Random int64 bits -> float32 strictly inside (0, 1): the top 23 bits, centred in their step.
    (24 bits would round the largest value up to exactly 1.0 in float32, and a Gumbel noise of
    +inf would then pick that token whatever its probability, even a masked one.)"""
    return (_shift_right(bits, 41).float() + 0.5) / float(1 << 23)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p set with -inf. logits ``[B, M, V]``."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, M, V]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]
    rank = torch.arange(vocab, device=logits.device)
    outside_k = rank[None, None, :] >= k[:, None, None]
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # [B, M, V] probability of strictly better tokens
    outside_p = mass_before >= top_p[:, None, None]
    drop_sorted = outside_k | outside_p
    drop_sorted[..., 0] = False  # the best token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class TokenLogprobs(NamedTuple):
    """The target's log-probabilities at a batch of positions ``[B, M]``, from its raw distribution
    (before temperature and filters, as vLLM reports them by default)."""

    chosen: torch.Tensor  # [B, M] float32: of the token chosen there
    top_values: torch.Tensor  # [B, M, k] float32: of the k likeliest tokens, best first
    top_ids: torch.Tensor  # [B, M, k] int64


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int, positions: torch.Tensor | None = None
                   ) -> TokenLogprobs:
    """logits ``[B, M, V]`` (or ``[B, N, V]`` read at ``positions`` ``[B, M]``), chosen ``[B, M]`` -> their
    :class:`TokenLogprobs` with the top ``k``; rows in groups of at most :data:`SAMPLE_CHUNK_ELEMENTS` values
    (each row's values depend on its own logits only)."""
    rows, width = chosen.shape
    vocab = logits.shape[-1]
    parts = []
    for group in _row_groups(rows, width * vocab):
        part = logits[group]
        if positions is not None:
            part = part.gather(1, positions[group, :, None].expand(-1, -1, vocab))  # [b, M, V]
        logp = torch.log_softmax(part.float(), dim=-1)  # [b, M, V]
        top_values, top_ids = logp.topk(min(k, vocab), dim=-1)  # [b, M, k] (k may be 0)
        parts.append((logp.gather(-1, chosen[group, :, None].long())[..., 0], top_values, top_ids))
    return TokenLogprobs(*(torch.cat(values) for values in zip(*parts)))


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability and its position's likeliest tokens (host values)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), best first


def logprob_records(values: TokenLogprobs, tokens: list[list[int]], ks: list[int | None]
                    ) -> list[list[TokenLogprob] | None]:
    """Host :class:`TokenLogprobs` ``[B, M(, k)]`` -> per row, the records of its ``tokens`` (its
    first positions) with its own ``ks[b]`` alternatives (None for a row that asked for none)."""
    chosen, top_values, top_ids = (t.tolist() for t in values)
    records: list[list[TokenLogprob] | None] = []
    for b, (row_tokens, k) in enumerate(zip(tokens, ks)):
        if k is None:
            records.append(None)
            continue
        records.append([TokenLogprob(token, chosen[b][j], tuple(zip(top_ids[b][j][:k], top_values[b][j][:k])))
                        for j, token in enumerate(row_tokens)])
    return records


# vocabulary-wide values the sampler holds per array at once: it samples a forward's rows in groups of at most this
# many (rows x positions x vocabulary) elements, so that a wide verify forward (thousands of positions over a
# 152k vocabulary) does not hold several int64 and float32 arrays of its whole [B, M, V] shape (tens of GB)
SAMPLE_CHUNK_ELEMENTS = 1 << 26


def choose_tokens(logits: torch.Tensor, sampling: SamplingTensors, out_index: torch.Tensor) -> torch.Tensor:
    """The target's choice at every position: argmax for greedy rows, a keyed Gumbel-max sample
    from the temperature / top-k / top-p processed distribution otherwise (rows in groups of
    :data:`SAMPLE_CHUNK_ELEMENTS`; each row's sample depends on its own logits, settings and key only).

    logits ``[B, M, V]`` float32; out_index ``[B, M]`` the generated-token index each choice fills.
    Returns ``[B, M]`` int64.
    """
    greedy = logits.argmax(-1)  # [B, M]
    if not sampling.any_sampled:
        return greedy
    rows, positions, vocab = logits.shape
    sampled = torch.cat([_sample(logits[group], _rows_of(sampling, group), out_index[group])
                         for group in _row_groups(rows, positions * vocab)])  # [B, M]
    return torch.where(sampling.temperature[:, None] > 0, sampled, greedy)


def _row_groups(rows: int, values_per_row: int) -> list[slice]:
    """Consecutive groups of ``rows`` of at most :data:`SAMPLE_CHUNK_ELEMENTS` values each (one row at least)."""
    group = max(1, SAMPLE_CHUNK_ELEMENTS // values_per_row)
    return [slice(start, start + group) for start in range(0, rows, group)]


def _rows_of(sampling: SamplingTensors, rows: slice) -> SamplingTensors:
    return sampling._replace(temperature=sampling.temperature[rows], top_p=sampling.top_p[rows],
                             top_k=sampling.top_k[rows], seed=sampling.seed[rows])


def _sample(logits: torch.Tensor, sampling: SamplingTensors, out_index: torch.Tensor) -> torch.Tensor:
    """Keyed Gumbel-max samples ``[b, M]`` of logits ``[b, M, V]`` after temperature and top-k / top-p."""
    temp = sampling.temperature.clamp(min=1e-5)[:, None, None]
    scaled = logits / temp
    if sampling.any_filtered:
        scaled = filter_logits(scaled, sampling.top_k, sampling.top_p)
    uniform = keyed_uniform(sampling.seed, out_index, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    return (scaled + gumbel).argmax(-1)
