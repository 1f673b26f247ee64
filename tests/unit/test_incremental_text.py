"""Incremental detokenization (engine/output.py TextTracker + request.DecodeState), through the
tokenizers library's DecodeStream and through the Python windows: at every step the tracked text is
the full decode when that ends in a complete character, else a prefix of it whose held-back rest ends
in an incomplete one (the Python windows: ``stable(decode(output_ids))``), and the final text equals
the full decode, for real text, emoji / CJK split across byte-level tokens, and random token ids
(specials too)."""

from __future__ import annotations

import random

import pytest

from flashtree.engine.output import TextTracker
from flashtree.engine.request import Request
from flashtree.sampling import SamplingParams

TEXTS = ["Hello world! It's a test: 3.14 , . ; '' \n\n def f(x):\n    return x ** 2",
         "Ünïcödé ✓ 漢字 テスト 😀👍🏽 emoji", "  leading spaces and\ttabs  "]


@pytest.fixture(scope="module")
def tokenizer():
    from flashtree.models.loader import load_checkpoint

    return load_checkpoint("smollm2", random_weights=True).tokenizer


@pytest.fixture(scope="module")
def tracker(tokenizer):
    return TextTracker(tokenizer)


@pytest.fixture(scope="module")
def windows(tokenizer):
    return TextTracker(tokenizer, rust_stream=False)


def sequences(tokenizer, rng: random.Random) -> list[list[int]]:
    real = [tokenizer.encode(t) for t in TEXTS]
    noise = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(60)]
    return real + noise


@pytest.mark.parametrize("kind", ["rust_stream", "python_windows"])
def test_incremental_text_is_the_full_decode_up_to_an_incomplete_character(kind, tracker, windows):
    chosen = tracker if kind == "rust_stream" else windows
    rng = random.Random(0)
    held_back_more = 0
    for ids in sequences(chosen.tokenizer, rng):
        req = Request(prompt_ids=[1], params=SamplingParams())
        while len(req.output_ids) < len(ids):
            take = rng.randint(1, 4)  # tokens per round, as speculative rounds commit
            req.output_ids.extend(ids[len(req.output_ids):len(req.output_ids) + take])
            text, full = chosen.text(req), chosen.decode(req.output_ids)
            assert full.startswith(text), req.output_ids
            held = full[len(text):]
            assert held == "" or held.endswith("\ufffd"), req.output_ids
            if kind == "python_windows":
                assert text == chosen.stable(full), req.output_ids
            held_back_more += text != chosen.stable(full)
        assert chosen.final_text(req) == chosen.decode(ids)
    assert kind == "python_windows" or held_back_more > 0  # (the random ids do end in split characters)


def test_each_step_decodes_a_window_not_the_whole_output(tracker, windows):
    """The Python windows decode a few tokens a step; the stream never calls the whole decode."""
    for chosen, most in ((windows, 8), (tracker, 0)):
        calls = []
        decode = chosen.decode
        chosen.decode = lambda ids: calls.append(len(ids)) or decode(ids)
        try:
            ids = chosen.tokenizer.encode("word " * 400)
            req = Request(prompt_ids=[1], params=SamplingParams())
            for token in ids:
                req.output_ids.append(token)
                chosen.text(req)
        finally:
            chosen.decode = decode
        assert len(ids) >= 400 and max(calls, default=0) <= most, max(calls)
        assert req.decoded.text == decode(ids)


def test_a_stream_that_does_not_line_up_falls_back_to_whole_decodes(tokenizer):
    """A DecodeStream that raises (the library's InvalidPrefix) leaves the request on whole decodes."""
    tracker = TextTracker(tokenizer)
    ids = tokenizer.encode(TEXTS[0])
    req = Request(prompt_ids=[1], params=SamplingParams())
    req.output_ids.extend(ids[:5])
    tracker.text(req)

    class Broken:
        def step(self, backend, token):
            raise Exception("InvalidPrefix")

    req.decoded.stream = Broken()
    req.output_ids.extend(ids[5:])
    assert tracker.text(req) == tracker.decode(ids) and req.decoded.exact_only
    assert tracker.final_text(req) == tracker.decode(ids)


def test_fast_decoder_matches_the_tokenizer(tracker):
    rng = random.Random(1)
    for ids in sequences(tracker.tokenizer, rng):
        assert tracker.decode(ids) == tracker.tokenizer.decode(ids, skip_special_tokens=True)


def test_non_incremental_text_is_decoded_once_at_the_end(tracker):
    """``incremental=False`` (batch jobs): no decoding while a request runs without stop strings,
    the full text when it finishes; a request with stop strings still tracks its text."""
    from flashtree.engine.output import append_tokens

    lazy = TextTracker(tracker.tokenizer, incremental=False)
    calls = []
    decode = lazy.decode
    lazy.decode = lambda ids: calls.append(len(ids)) or decode(ids)
    ids = tracker.tokenizer.encode(TEXTS[1] + TEXTS[0])
    req = Request(prompt_ids=[1], params=SamplingParams(max_tokens=len(ids)))
    for start in range(0, len(ids), 3):
        event = append_tokens(req, ids[start:start + 3], lazy, max_context=4096)
        assert calls == [] or event.finished
    assert req.finished and req.text == tracker.decode(ids) and event.new_text == req.text
    stopped = Request(prompt_ids=[1], params=SamplingParams(max_tokens=len(ids), stop=("return",)))
    for start in range(0, len(ids), 3):
        append_tokens(stopped, ids[start:start + 3], lazy, max_context=4096)
        if stopped.finished:
            break
    full = tracker.decode(ids)
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index("return")]
