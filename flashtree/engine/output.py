"""Appending committed tokens to a request: stop conditions, incremental text, step events.

Stop conditions are checked token by token on the committed tokens of a round, so no token
past a stop (stop token id, end of turn, stop string, max_tokens, context end) is ever emitted.
"""

from __future__ import annotations

from typing import NamedTuple

from tokenizers.decoders import DecodeStream

from flashtree.engine.request import Request, Status
from flashtree.sampling import TokenLogprob


class StepEvent(NamedTuple):
    """What one engine step produced for one request (the unit a stream sends)."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    finished: bool
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


class TextTracker:
    """Decodes a request's output incrementally (:class:`DecodeState`); holds back an incomplete
    UTF-8 tail so deltas are clean. With a Rust tokenizer that decodes as the fast decoder does, the
    tokenizers library's ``DecodeStream`` does the windows (one call per new token, about half the
    Python windows' host time: benchmarks/detok_overhead.py); otherwise the windows run here.

    ``incremental=False``: requests without stop strings get their text only when they finish
    (one full decode), not after every step; for batch jobs nobody streams (regeneration, bench),
    where per-step decoding of hundreds of rows is host time the device waits for."""

    def __init__(self, tokenizer, incremental: bool = True, rust_stream: bool = True):
        self.tokenizer = tokenizer
        self.incremental = incremental
        self._decode = _fast_decoder(tokenizer)
        self._backend = _rust_decoder(tokenizer) if rust_stream else None  # (None: the windows run in Python)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self._decode(token_ids)

    def needs_text(self, req: Request) -> bool:
        """The request's text must be kept current after this step (streamed, or stop strings)."""
        return self.incremental or bool(req.params.stop)

    @staticmethod
    def stable(text: str) -> str:
        return text[:-1] if text.endswith("\ufffd") else text

    def text(self, req: Request) -> str:
        """The decoded output so far, without an incomplete UTF-8 tail (it waits for its bytes): a
        prefix of ``decode(output_ids)``, at the cost of decoding a few tokens. The Python windows give
        ``stable(decode(output_ids))``; a DecodeStream may hold back more while invalid bytes end the
        output (random models), and gives the same text once a complete character follows."""
        state, ids = req.decoded, req.output_ids
        if self._backend is not None and not state.exact_only:
            return self._streamed_text(req)
        if state.exact_only:
            return self.stable(self.decode(ids))
        prefix = self.decode(ids[state.prefix_offset:state.read_offset])
        window = self.decode(ids[state.prefix_offset:])
        if not window.startswith(prefix):  # windows do not line up for this tokenizer
            state.exact_only = True
            return self.stable(self.decode(ids))
        if window.endswith("\ufffd"):  # keep the window open until the character completes
            return state.text + self.stable(window[len(prefix):])
        if len(window) > len(prefix):
            state.text += window[len(prefix):]
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        return state.text

    def _streamed_text(self, req: Request) -> str:
        """``text`` through the request's DecodeStream; a window that does not line up (the stream
        raises) sends the request to whole decodes, as the Python windows do."""
        state, ids = req.decoded, req.output_ids
        if state.stream is None:
            state.stream = DecodeStream(skip_special_tokens=True)
        try:
            for token in ids[state.read_offset:]:
                new_text = state.stream.step(self._backend, token)
                if new_text is not None:
                    state.text += new_text
        except Exception:  # noqa: BLE001 - the library's InvalidPrefix (a tokenizer whose windows differ)
            state.exact_only, state.stream = True, None
            return self.stable(self.decode(ids))
        state.read_offset = len(ids)
        return state.text

    def final_text(self, req: Request) -> str:
        """The whole decoded output, an incomplete tail included (what a full decode gives)."""
        state, ids = req.decoded, req.output_ids
        if state.exact_only or self._backend is not None:
            return self.decode(ids)
        self.text(req)
        prefix = self.decode(ids[state.prefix_offset:state.read_offset])
        window = self.decode(ids[state.prefix_offset:])
        return state.text + window[len(prefix):] if window.startswith(prefix) else self.decode(ids)


def append_tokens(req: Request, tokens: list[int], tracker: TextTracker, max_context: int,
                  logprobs: list[TokenLogprob] | None = None, stop_at_last: bool = False) -> StepEvent:
    """Append ``tokens`` (and their ``logprobs``, when the request asked) to ``req`` until a stop
    condition; returns the step's event. ``stop_at_last``: the last token is a stop token too (the one that
    completed the request's grammar)."""
    params = req.params
    old_text = req.text
    added: list[int] = []
    text_final = False  # set when a stop string truncated the text
    for i, token in enumerate(tokens):
        req.output_ids.append(token)
        added.append(token)
        if token in req.stop_token_ids or (stop_at_last and i == len(tokens) - 1):
            _finish(req, "stop")
            req.stopped_by = token
            break
        if params.stop and len(req.output_ids) >= params.min_tokens and _hit_stop_string(req, tracker):
            text_final = True
            break
        if len(req.output_ids) >= params.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= max_context:
            _finish(req, "length")
            break
    if not text_final:
        if req.finished:
            req.text = tracker.final_text(req)
        elif tracker.needs_text(req):
            req.text = _without_stop_prefix(tracker.text(req), params.stop)
    delta = req.text[len(old_text):] if req.text.startswith(old_text) else req.text
    new_logprobs = None
    if logprobs is not None:
        new_logprobs = logprobs[:len(added)]
        req.output_logprobs.extend(new_logprobs)
    return StepEvent(req, added, delta, req.finished, new_logprobs)


def _rust_decoder(tokenizer):
    """The Rust tokenizer when :func:`_fast_decoder` decodes through it (``DecodeStream`` then gives
    its text), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


def _fast_decoder(tokenizer):
    """``tokenizer.decode(ids, skip_special_tokens=True)``, through the Rust tokenizer directly
    when that gives the same text (a fast tokenizer that does not clean up spaces): a third of
    the time per call, which adds up at a few calls per row per step."""
    backend = _rust_decoder(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _hit_stop_string(req: Request, tracker: TextTracker) -> bool:
    text = tracker.text(req)
    longest = max(len(s) for s in req.params.stop)
    search_from = max(0, len(req.text) - longest)
    hits = [i for i in (text.find(s, search_from) for s in req.params.stop) if i >= 0]
    if not hits:
        req.text = _without_stop_prefix(text, req.params.stop)
        return False
    first = min(hits)
    req.text = text[:first]
    req.stopped_by = next(s for s in req.params.stop if text.find(s, search_from) == first)
    _finish(req, "stop")
    return True


def _without_stop_prefix(text: str, stops: tuple[str, ...]) -> str:
    """``text`` minus its longest tail that begins some stop string: that tail is held back
    until the stop string is ruled out, so emitted text only ever grows (clean stream deltas)."""
    for size in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return text[:-size]
    return text


def _finish(req: Request, reason: str) -> None:
    req.finish_reason = reason
    req.status = Status.FINISHED
