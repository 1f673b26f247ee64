"""The paged KV cache in the engine: every decoding method gives the plain tokens at any page size
(pages of one entry, of an odd size, of 16), a pool too small for every request at once makes
requests wait for pages instead of failing and changes no token, and every page comes back."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.errors import RequestError
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB

PARAMS = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, temperature=0.0 if i % 3 else 0.8, seed=i)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("paged"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def expected(pair):
    outs = LLM(str(pair.target), **ENGINE).generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs]


def _llm(pair, method: str, **settings) -> LLM:
    drafted = dict(spec=method, draft=str(pair.drafter), budget=6) if method != "none" else {}
    return LLM(str(pair.target), **drafted, **{**ENGINE, **settings})


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_every_method_gives_the_plain_tokens_at_any_page_size(pair, expected, method, page_size):
    llm = _llm(pair, method, page_size=page_size)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    pool = llm.engine.pages.pool
    assert pool.used_pages == len(llm.engine.pages.pages_of(llm.engine.runner.pad_slot))  # all back but the pad slot's


@pytest.mark.parametrize("method", ["none", "ddtree"])
def test_a_small_pool_makes_requests_wait_and_changes_no_token(pair, expected, method):
    page_size, kv_pages = 4, 24  # about two requests' worth of pages
    llm = _llm(pair, method, page_size=page_size, kv_pages=kv_pages)
    engine = llm.engine
    requests = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS)]
    most_running, held_bound_ok = 0, True
    while engine.has_work:
        engine.step()
        running = [r for r in engine.scheduler.active if not r.finished]
        most_running = max(most_running, len(running))
        # pages in use: what the rows hold, plus at most a round's scratch and one partial page each
        used = engine.pages.pool.used_pages - len(engine.pages.pages_of(engine.runner.pad_slot))
        bound = sum(-(-(r.committed_length + engine.runner.span) // page_size) for r in running)
        held_bound_ok &= used <= bound
        assert engine.scheduler.promised <= engine.scheduler.pages.capacity
    assert [r.output_ids for r in requests] == expected
    assert 1 < most_running < len(PROMPTS) and held_bound_ok


def test_a_request_the_pool_can_never_hold_is_refused(pair):
    llm = _llm(pair, "none", page_size=4, kv_pages=8)
    with pytest.raises(RequestError, match="may reach .* KV pages of 4 tokens .* the pool holds 8; lower max_tokens"):
        llm.engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40))


SHARED = list(range(2, 22)) * 2  # a 40-token "system prompt"
SUFFIXED = [SHARED + [5, 6, 7], SHARED + [9], SHARED, SHARED[:17] + [1, 1, 2]]
OTHER = list(range(23, 3, -1)) * 2  # shares nothing with them


@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_prefix_caching_reuses_pages_and_changes_no_token(pair, method):
    """Requests that share a prefix with earlier ones prefill only what follows it (whole pages, at
    least one token computed), with the same tokens as without the cache; a pool too small to keep
    everything evicts cached pages and stays right."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = SUFFIXED + [OTHER, SUFFIXED[0]]
    reference = _llm(pair, method, page_size=4)
    expected = [reference.generate([p], params)[0].token_ids for p in prompts]
    for kv_pages in (None, 16):
        llm = _llm(pair, method, page_size=4, prefix_caching=True, kv_pages=kv_pages)
        got, cached = [], []
        for prompt in prompts:  # one at a time: each finds what the ones before left
            req = llm.engine.add_request(prompt, params)
            llm.engine.run_until_done([req])
            got.append(req.output_ids)
            cached.append(req.cached_tokens)
        assert got == expected
        assert cached[:5] == [0, 40, 36, 16, 0] and llm.engine.prefix_cache.hit_tokens == sum(cached)
        assert cached[5] == (40 if kv_pages is None else 0)  # the small pool gave the pages to OTHER


def test_requests_admitted_with_a_cached_prefix_prefill_only_the_rest_in_one_step(pair):
    llm = _llm(pair, "ddtree", page_size=4, prefix_caching=True)  # prefill chunks of 8 tokens
    engine = llm.engine
    first = engine.add_request(SUFFIXED[0], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_done([first])  # 43 tokens: 6 prefill steps
    later = [engine.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True)) for p in SUFFIXED[1:3]]
    engine.step()  # admission maps 40 and 36 cached tokens: 1 and 4 tokens left, one chunk each
    assert all(r.output_ids for r in later) and [r.cached_tokens for r in later] == [40, 36]


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_prompt_the_drafter_deferred_is_cached_once_it_caught_up(pair, method):
    """A prompt of one prefill chunk that fits the drafter's lag is prefilled without the drafter (its
    features wait for the next catch-up); its pages join the prefix cache at that catch-up, not
    before (the drafter's context entries on them are written only then), with the plain tokens."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    short = [3, 9, 4, 11, 7, 2, 15, 6]  # two pages of 4, one prefill chunk
    prompts = [short, short + [5], short[:4] + [8, 8]]
    expected = [_llm(pair, "none", page_size=4).generate([p], params)[0].token_ids for p in prompts]
    llm = _llm(pair, method, page_size=4, prefix_caching=True)
    first = llm.engine.add_request(prompts[0], params)
    llm.engine.step()  # the prefill: deferred, so nothing is findable yet
    assert first.drafter_lag == len(short) and llm.engine.prefix_cache.cached_pages == 0
    llm.engine.run_until_done([first])
    got, cached = [first.output_ids], [first.cached_tokens]
    for prompt in prompts[1:]:
        req = llm.engine.add_request(prompt, params)
        llm.engine.run_until_done([req])
        got.append(req.output_ids)
        cached.append(req.cached_tokens)
    assert got == expected and cached == [0, 8, 4]
