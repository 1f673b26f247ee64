"""min_tokens and repetition / frequency / presence penalties: the chosen tokens follow the adjusted
distribution of every output position (checked against a recompute with transformers), and every
speculative method gives exactly the plain tokens with them, greedy and sampled, in batches that mix
adjusted and plain rows."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.errors import RequestError
from tests.dflash_helpers import PassThroughGraphs, one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB

ADJUSTED = [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(min_tokens=9, stop_token_ids=(3, 4, 5)), dict(repetition_penalty=0.6, presence_penalty=-1.0),
    dict(frequency_penalty=0.7, repetition_penalty=1.3, min_tokens=4), dict(), dict(frequency_penalty=-0.5),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("penalties"), vocab=VOCAB, block_size=BLOCK)


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=14, ignore_eos=True, temperature=temperature, seed=i, **kw)
            for i, kw in enumerate(ADJUSTED)]


def _llm(pair, method: str) -> LLM:
    drafted = dict(spec=method, draft=str(pair.drafter), budget=8) if method != "none" else {}
    return LLM(str(pair.target), **drafted, **ENGINE)


@pytest.fixture(scope="module")
def plain(pair):
    return _llm(pair, "none")


def _adjusted_reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        stop_ids: set[int]) -> torch.Tensor:
    """vLLM's definitions, one position at a time, in float64."""
    logits = logits.double().clone()
    seen = set(prompt) | set(output)
    for token in seen:
        r = params.repetition_penalty
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    if len(output) < params.min_tokens:
        logits[sorted(stop_ids)] = float("-inf")
    return logits


def test_greedy_tokens_follow_the_adjusted_distribution(pair, plain):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(pair.target), torch_dtype=torch.float32).eval()
    params = _params(0.0)
    outs = plain.generate(PROMPTS, params)
    checked = 0
    for prompt, p, out in zip(PROMPTS, params, outs):
        stop_ids = set(p.stop_token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:]  # [T, V]
        for k, token in enumerate(out.token_ids):
            adjusted = _adjusted_reference(logits[k], prompt, out.token_ids[:k], p, stop_ids)
            top2 = adjusted.topk(2).values
            if top2[0] - top2[1] > 1e-4:  # not a near tie: the choice is determined
                assert token == int(adjusted.argmax()), (prompt, k)
                checked += 1
        if p.min_tokens:
            assert not stop_ids & set(out.token_ids[:p.min_tokens])
    unadjusted = plain.generate(PROMPTS, [SamplingParams(max_tokens=14, ignore_eos=True)] * len(PROMPTS))
    assert checked > 80 and sum(a.token_ids != b.token_ids for a, b in zip(outs, unadjusted)) >= 5


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_speculation_gives_the_plain_tokens_with_adjustments(pair, plain, method, temperature, graphed):
    """``graphed``: rounds go through a pass-through graph cache whose first run of a key runs the
    round twice, as a CUDA-graph capture does: the counts must not count a token twice."""
    params = _params(temperature)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = _llm(pair, method)
    if graphed:
        llm.engine.runner.graphs = PassThroughGraphs()
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    if method != "none":
        assert max(max(o.acceptance_lengths) for o in outs) > 1  # trees were accepted, not only roots


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(plain):
    free = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop = free.token_ids[2]  # a token the free run emits early
    assert len(free.text) >= 3
    for kind in ("token", "string"):
        stops = dict(stop_token_ids=(stop,)) if kind == "token" else dict(stop=(free.text[:3],))
        early = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, **stops))[0]
        late = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, min_tokens=10, **stops))[0]
        assert len(early.token_ids) <= 3 and early.finish_reason == "stop", kind
        assert len(late.token_ids) >= 10, kind
        if kind == "token":
            assert stop not in late.token_ids[:10]


@pytest.mark.parametrize("field,value", [("min_tokens", 200), ("min_tokens", -1), ("presence_penalty", 2.5),
                                         ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(max_tokens=100, **{field: value})
