"""Emitted tokens' log-probabilities -> OpenAI's two shapes.

The engine thread turns each token id into its text (:class:`TokenTexts`, the id decoded alone with
special tokens kept, as vLLM does; ``token_id:<id>`` without a tokenizer) and sends
:class:`LogprobText` entries with the deltas; the HTTP side renders them:

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  with ``top_logprobs`` alternatives per token;
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
  each ``top_logprobs`` dict holding the ``logprobs`` likeliest tokens and the chosen one.

Values are the target's raw log-probabilities (before temperature and filters); a value below
:data:`FLOOR` (``-inf`` included, which JSON cannot carry) is sent as ``FLOOR``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from flashtree.sampling import TokenLogprob
from flashtree.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

FLOOR = -9999.0


class LogprobText(NamedTuple):
    """One emitted token's log-probability with its text, and its position's likeliest tokens."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]  # (token text, log-probability), best first


class TokenTexts:
    """Token id -> its text, remembered (engine thread: the engine's tokenizer is not shared)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = (f"token_id:{token_id}" if self.tokenizer is None
                                            else self.tokenizer.decode([token_id]))
        return text

    def entries(self, records: Sequence[TokenLogprob]) -> tuple[LogprobText, ...]:
        return tuple(LogprobText(self(r.token), _bounded(r.logprob), tuple((self(t), _bounded(v)) for t, v in r.top))
                     for r in records)


def chat_logprobs(entries: Sequence[LogprobText]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=_bytes(e.token),
                         top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_bytes(t)) for t, v in e.top])
        for e in entries])


def completion_logprobs(entries: Sequence[LogprobText], text_offset: int) -> CompletionLogprobs:
    """``text_offset``: where the first entry's token starts in the choice's text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{**dict(e.top), e.token: e.logprob} for e in entries],
                              text_offset=offsets)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _bounded(value: float) -> float:
    return max(value, FLOOR)
