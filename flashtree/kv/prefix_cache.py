"""Automatic prefix caching: full KV pages of prompt tokens, found again by their content.

Glossary
- page key: a hash of a full page's tokens and the key of the page before it, so a key names the
  whole prefix up to the page's end (the same tokens after another prefix make another key).
- hit: a new request's first ``k`` full prompt pages have keys the cache holds; the request maps
  those pages (shared, read-only: every later write of the request goes past them) and starts its
  prefill at position ``k * page_size``. At least one prompt token is always computed, since the
  first output token needs its logits.
- registered: a page of a prefill's committed prompt tokens, made findable once its K/V (and the
  drafter's context K/V, which the target's features of the same tokens fully decide) are written.
  Once no slot maps it, the page stays evictable in the pool until an allocation needs it
  (least recently released first), and the cache forgets it then.

Lossless: a page's K/V depend only on the tokens before and in it and their positions, which the
key pins down; the tokens themselves are compared on every hit, so a hash collision cannot serve
wrong entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from flashtree.kv.pages import PagePool

ROOT_KEY = 0


class CachedPage(NamedTuple):
    page: int
    parent: int  # key of the page before it (ROOT_KEY for a prompt's first page)
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._by_key: dict[int, CachedPage] = {}
        self._key_of_page: dict[int, int] = {}
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # prompt tokens served from cached pages
        pool.on_evict = self._forget

    def _keys(self, tokens: Sequence[int], pages: int, first: int = 0, parent: int = ROOT_KEY
              ) -> list[tuple[int, int, tuple[int, ...]]]:
        """(key, parent key, tokens) of full pages ``first`` .. ``pages - 1`` of ``tokens``; ``parent``: the key
        of page ``first - 1``."""
        out = []
        for i in range(first, pages):
            chunk = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
            key = hash((parent, chunk))
            out.append((key, parent, chunk))
            parent = key
        return out

    def match(self, prompt: Sequence[int]) -> list[int]:
        """Pages holding the longest cached prefix of ``prompt`` (full pages, leaving at least one
        token to compute), to map in the request's slot (``PageTable.share``)."""
        usable = (len(prompt) - 1) // self.page_size
        pages = []
        for key, parent, chunk in self._keys(prompt, usable):
            cached = self._by_key.get(key)
            if cached is None or cached.parent != parent or cached.tokens != chunk:
                break
            pages.append(cached.page)
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def register(self, prompt: Sequence[int], computed: int, pages: Sequence[int]) -> None:
        """Make the full pages of the first ``computed`` prompt tokens findable; ``pages``: the
        slot's pages in order. A key the cache already holds keeps its page."""
        full, known, parent = computed // self.page_size, 0, ROOT_KEY
        while known < full and pages[known] in self._key_of_page:  # found or registered before: their keys
            parent = self._key_of_page[pages[known]]  # name this prompt's prefix (a mapped page is never evicted)
            known += 1
        for i, (key, parent, chunk) in enumerate(self._keys(prompt, full, known, parent), known):
            if key in self._by_key or pages[i] in self._key_of_page:
                continue
            self._by_key[key] = CachedPage(pages[i], parent, chunk)
            self._key_of_page[pages[i]] = key
            self.pool.remember(pages[i])

    def _forget(self, page: int) -> None:
        key = self._key_of_page.pop(page, None)
        if key is not None:
            del self._by_key[key]

    @property
    def cached_pages(self) -> int:
        return len(self._by_key)
