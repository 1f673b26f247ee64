"""Automatic prefix caching: pages found again by their content and their whole prefix, at least one
prompt token left to compute, evictable pages forgotten when an allocation takes them."""

from __future__ import annotations

import pytest

from flashtree.kv.pages import PagePool, PageTable
from flashtree.kv.prefix_cache import PrefixCache


def _registered(prompt: list[int], page_size: int = 4, pool_pages: int = 12):
    table = PageTable(PagePool(pool_pages), max_slots=3, max_tokens=40, page_size=page_size, device="cpu")
    cache = PrefixCache(table.pool, page_size)
    table.ensure([0], [len(prompt)])
    cache.register(prompt, len(prompt), table.pages_of(0))
    return table, cache


def test_a_prompt_finds_the_pages_of_its_longest_cached_prefix():
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages of 4
    table, cache = _registered(prompt)
    assert cache.cached_pages == 3
    owned = table.pages_of(0)
    assert cache.match(prompt) == owned[:3]  # 12 tokens cached, the 13th is computed
    assert cache.match(prompt[:12]) == owned[:2]  # the last token is always computed
    assert cache.match(prompt[:8] + [0, 0, 0, 0, 0]) == owned[:2]  # stops at the first other page
    assert cache.match([99] + prompt[1:]) == []  # a different first page: nothing after it matches either
    assert cache.queried_tokens == 13 + 12 + 13 + 13 and cache.hit_tokens == 4 * (3 + 2 + 2)


def test_the_same_page_after_another_prefix_is_another_page():
    table, cache = _registered([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.match([7, 7, 7, 7, 5, 6, 7, 8, 9]) == []


def test_shared_pages_outlive_their_first_slot_and_are_evicted_last_released_last():
    prompt = list(range(9))
    table, cache = _registered(prompt, pool_pages=6)  # 5 pages to hand out
    pages = cache.match(prompt)
    table.share(1, pages)  # a second request maps them
    table.release([0])
    assert table.pool.refcounts[pages[0]] == 1 and cache.match(prompt) == pages
    table.release([1])  # nobody maps them now: evictable, still found, counted as free
    assert table.pool.free_pages == 5 and cache.match(prompt) == pages
    table.share(2, pages[:1])  # taken back from the evictable list
    assert table.pool.refcounts[pages[0]] == 1 and table.pool.free_pages == 4
    table.ensure([0], [16])  # 4 pages: the 3 free ones first (the third held the partial page), then pages[1]
    assert pages[1] in table.pages_of(0) and cache.cached_pages == 1
    assert cache.match(prompt) == pages[:1]


def test_a_hit_extended_registers_its_new_pages_under_the_whole_prefix():
    """A request that mapped cached pages registers only the pages after them, keyed by the whole prompt: a
    later prompt finds all of them, and a prompt that differs in the mapped part finds none of the new ones."""
    system = list(range(1, 9))  # 2 full pages of 4
    table, cache = _registered(system + [50])
    table.share_many([(1, cache.match(system + [60, 61, 62, 63, 64]))])
    table.ensure([1], [13])  # the request's own pages after the shared two
    cache.register(system + [60, 61, 62, 63, 64], 13, table.pages_of(1))
    assert cache.cached_pages == 3 and table.pages_of(1)[:2] == table.pages_of(0)[:2]
    assert cache.match(system + [60, 61, 62, 63, 99]) == table.pages_of(1)[:3]
    assert cache.match([0] + system[1:] + [60, 61, 62, 63, 99]) == []
    assert set(cache._by_key) == {key for key, _, _ in cache._keys(system + [60, 61, 62, 63, 64], 3)}  # (whole-prompt keys)


def test_share_many_maps_each_slot_and_refuses_a_slot_that_maps_pages():
    table, cache = _registered(list(range(9)))
    pages = cache.match(list(range(9)))
    table.share_many([(1, pages), (2, pages[:1])])
    assert table.pages_of(1) == pages and table.pages_of(2) == pages[:1]
    assert table.block_table[1, :2].tolist() == pages and table.pool.refcounts[pages[0]] == 3
    with pytest.raises(ValueError, match="slot 1 already maps 2 pages"):
        table.share_many([(1, pages)])
