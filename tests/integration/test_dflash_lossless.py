"""DFlash (chain) decoding is lossless: greedy tokens equal plain greedy decoding for batches
with rows of different lengths and stop conditions; a copying drafter reaches full blocks;
sampled tokens follow the target's distribution and seeded runs equal plain decoding."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import (
    assert_first_tokens_match_target,
    one_thread,
    sample_first_tokens,
    tiny_pair,
    use_copying_proposer,
)
from tests.support.workload import (
    BLOCK,
    ENGINE,
    PROMPTS,
    SAMPLE_ENGINE,
    SAMPLE_PROMPT,
    SAMPLE_VOCAB,
    VOCAB,
    mixed_params,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("dflash"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


@pytest.fixture(scope="module")
def dflash(pair):
    return LLM(str(pair.target), spec="dflash", draft=str(pair.drafter), **ENGINE)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_greedy_equals_plain(plain, dflash, rows):
    prompts = PROMPTS[:rows] if rows > 1 else PROMPTS[1:2]
    params = mixed_params(plain, prompts)
    expected = plain.generate(prompts, params)
    got = dflash.generate(prompts, params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert sum(out.acceptance_lengths) >= len(out.token_ids) - 1  # every token after the first came from a round
    if rows > 1:
        assert {o.finish_reason for o in got} == {"stop", "length"}


def test_more_requests_than_slots(plain, dflash):
    """Finished requests free their slot (target and drafter caches) for waiting ones."""
    prompts = PROMPTS + PROMPTS[::-1][:5]
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in dflash.generate(prompts, params)] == expected


def test_copying_drafter_reaches_full_blocks(pair, plain, monkeypatch):
    made = use_copying_proposer(monkeypatch, depth=BLOCK - 1)
    llm = LLM(str(pair.target), spec="dflash", draft=str(pair.drafter), **ENGINE)
    made[-1].attach(llm.engine)
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    prompts = PROMPTS[:3]
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    lengths = [n for o in got for n in o.acceptance_lengths]
    assert max(lengths) == BLOCK and sum(n == BLOCK for n in lengths) >= 0.9 * len(lengths)
    assert all(o.acceptance_lengths == [BLOCK] * 3 for o in got)  # 1 + 3 x 4 = 13 tokens


# ---------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("dflash_small"), vocab=SAMPLE_VOCAB, block_size=BLOCK, tokenizer=False)
    plain = LLM(str(pair.target), **SAMPLE_ENGINE)
    dflash = LLM(str(pair.target), spec="dflash", draft=str(pair.drafter), **SAMPLE_ENGINE)
    return pair, plain, dflash


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.9}])
def test_sampled_tokens_follow_the_target(small, filters):
    pair, _, dflash = small
    samples = sample_first_tokens(dflash, SAMPLE_PROMPT, range(3000), temperature=1.0, **filters)
    assert_first_tokens_match_target(samples, pair.hf, SAMPLE_PROMPT, temperature=1.0, **filters)


def test_seeded_sampling_equals_plain(small):
    _, plain, dflash = small
    prompts = [SAMPLE_PROMPT, [5, 6], [7] * 9]
    params = [SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)] * 20)]
    many = [prompts[i % 3] for i in range(len(params))]
    assert [o.token_ids for o in dflash.generate(many, params)] == [o.token_ids for o in plain.generate(many, params)]
