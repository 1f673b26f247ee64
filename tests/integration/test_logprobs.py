"""Log-probabilities of the emitted tokens: those of the target's raw distribution at each output
position (checked against a full recompute with transformers), the same in plain, DFlash and
DDTree decoding (greedy and sampled), one per emitted token whatever the stop condition, and
each row's own number of alternatives."""

from __future__ import annotations

import math

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB, mixed_params

TOLERANCE = 1e-5  # float32 on a CPU; plain and tree forwards sum in different orders


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("logprobs"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def engines(pair):
    return {
        "plain": LLM(str(pair.target), **ENGINE),
        "dflash": LLM(str(pair.target), spec="dflash", draft=str(pair.drafter), **ENGINE),
        "ddtree": LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=16, **ENGINE),
        "queued": LLM(str(pair.target), **ENGINE, queue_plain_rounds=True),  # each round queued before the last is read
    }


def with_logprobs(params: list[SamplingParams], ks: list[int | None]) -> list[SamplingParams]:
    return [SamplingParams(**{**p.__dict__, "logprobs": k}) for p, k in zip(params, ks)]


def reference_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]``: log-softmax of the target's logits at each output position (full recompute)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def test_plain_logprobs_are_the_targets(engines, pair):
    ks = [5, 0, 20, 1, 3, 7, 2, 4]
    params = with_logprobs(mixed_params(engines["plain"], PROMPTS), ks)
    for prompt, k, out in zip(PROMPTS, ks, engines["plain"].generate(PROMPTS, params)):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        expected = reference_logprobs(pair.hf.float(), prompt, out.token_ids)
        for j, (token, record) in enumerate(zip(out.token_ids, out.logprobs)):
            assert record.token == token
            assert abs(record.logprob - expected[j, token].item()) < TOLERANCE
            assert len(record.top) == k
            top_values, top_ids = expected[j].topk(k)
            assert [t for t, _ in record.top] == top_ids.tolist()
            assert all(abs(v - e) < TOLERANCE for (_, v), e in zip(record.top, top_values.tolist()))
            if k:  # greedy: the chosen token is the likeliest
                assert record.top[0][0] == token and record.top[0][1] == record.logprob


@pytest.mark.parametrize("spec", ["dflash", "ddtree", "queued"])
@pytest.mark.parametrize("sampled", [False, True])
def test_speculative_logprobs_equal_plain(engines, spec, sampled):
    ks = [3, None, 20, 0, 1, None, 5, 2]
    base = mixed_params(engines["plain"], PROMPTS)
    if sampled:
        base = [SamplingParams(**{**p.__dict__, "temperature": 0.8, "top_p": 0.9, "seed": 17 + i})
                for i, p in enumerate(base)]
    params = with_logprobs(base, ks)
    expected = engines["plain"].generate(PROMPTS, params)
    got = engines[spec].generate(PROMPTS, params)
    if spec == "queued":
        assert engines[spec].engine.queued_rounds > 0
    else:
        assert any(len(o.token_ids) > o.rounds for o in got)  # some rounds accepted drafts
    for ref, out, k in zip(expected, got, ks):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        if k is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(out.token_ids)
        for a, b in zip(ref.logprobs, out.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < TOLERANCE
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < TOLERANCE for (_, x), (_, y) in zip(a.top, b.top))
            assert math.isfinite(b.logprob) and b.logprob <= 0


def test_logprobs_are_optional_per_row(engines):
    """A row that asked for none gets none; asking changes no token."""
    params = [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=k) for k in (None, 2)]
    plain = engines["ddtree"].generate(PROMPTS[:2], [SamplingParams(max_tokens=9, ignore_eos=True)] * 2)
    outs = engines["ddtree"].generate(PROMPTS[:2], params)
    assert outs[0].logprobs is None and len(outs[1].logprobs) == 9
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
