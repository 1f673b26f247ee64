"""Incremental detokenization (engine/output.py TextTracker + request.DecodeState): at every step
the tracked text equals ``stable(decode(output_ids))`` and the final text equals the full decode,
for real text, emoji / CJK split across byte-level tokens, and random token ids (specials too)."""

from __future__ import annotations

import random

import pytest

from flashtree.engine.output import TextTracker
from flashtree.engine.request import Request
from flashtree.sampling import SamplingParams

TEXTS = ["Hello world! It's a test: 3.14 , . ; '' \n\n def f(x):\n    return x ** 2",
         "Ünïcödé ✓ 漢字 テスト 😀👍🏽 emoji", "  leading spaces and\ttabs  "]


@pytest.fixture(scope="module")
def tracker():
    from flashtree.models.loader import load_checkpoint

    return TextTracker(load_checkpoint("smollm2", random_weights=True).tokenizer)


def sequences(tokenizer, rng: random.Random) -> list[list[int]]:
    real = [tokenizer.encode(t) for t in TEXTS]
    noise = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(60)]
    return real + noise


def test_incremental_text_equals_the_full_decode_at_every_step(tracker):
    rng = random.Random(0)
    for ids in sequences(tracker.tokenizer, rng):
        req = Request(prompt_ids=[1], params=SamplingParams())
        while len(req.output_ids) < len(ids):
            take = rng.randint(1, 4)  # tokens per round, as speculative rounds commit
            req.output_ids.extend(ids[len(req.output_ids):len(req.output_ids) + take])
            assert tracker.text(req) == tracker.stable(tracker.decode(req.output_ids)), req.output_ids
        assert tracker.final_text(req) == tracker.decode(ids)


def test_each_step_decodes_a_window_not_the_whole_output(tracker):
    calls = []
    decode = tracker.decode
    tracker.decode = lambda ids: calls.append(len(ids)) or decode(ids)
    try:
        ids = tracker.tokenizer.encode("word " * 400)
        req = Request(prompt_ids=[1], params=SamplingParams())
        for token in ids:
            req.output_ids.append(token)
            tracker.text(req)
    finally:
        tracker.decode = decode
    assert len(ids) >= 400 and max(calls) <= 8, max(calls)


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
