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
