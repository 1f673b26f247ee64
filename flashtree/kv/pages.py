"""KV pages: the pool they come from and the block tables that map each slot's positions to them.

Glossary
- page: ``page_size`` consecutive KV entries of one slot, in every layer (never called a block:
  block is the drafter's). Page 0 is the null page: it is never handed out, and every block-table
  entry that maps nothing points to it, so a write past a slot's mapped pages (padding, the tail of
  a padded catch-up) lands there harmlessly and nothing reads it as context.
- block table: ``[max_slots, pages_per_slot]`` page ids on the device; entry ``p`` of slot ``s``
  holds positions ``p * page_size .. (p + 1) * page_size - 1`` of that slot.
- mapped: a slot's first ``len(pages_of(slot))`` table entries point at its own pages. The engine
  maps a slot's pages before a forward writes there (:meth:`PageTable.ensure`); they go back to
  the pool when the request ends (:meth:`PageTable.release`).
- refcount: how many slots map a page. A page returns to the free list when its count reaches 0,
  so two slots can share a page (a shared prefix) and neither frees it under the other.
- evictable: a page nobody maps that the prefix cache (``kv/prefix_cache.py``) still remembers. It
  counts as free; :meth:`PagePool.allocate` takes free pages first, then the least recently
  released evictable ones (telling the prefix cache to forget them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from flashtree.device_copy import to_device
from flashtree.errors import FlashtreeError

NULL_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` positions."""
    return -(-tokens // page_size)


class OutOfPagesError(FlashtreeError):
    """The page pool has fewer free pages than a slot needs (the scheduler's reservation prevents it)."""


class PagePool:
    """Page ids ``1 .. num_pages - 1`` with reference counts (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.refcounts = [0] * num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # popped from the end: lowest ids first
        self._remembered: set[int] = set()  # pages the prefix cache knows (in use or evictable)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # remembered pages nobody maps, oldest first
        self.on_evict: Callable[[int], None] | None = None  # told when an evictable page is taken

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take (free, or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def used_pages(self) -> int:
        """Pages some slot maps."""
        return self.capacity - self.free_pages

    def allocate(self, count: int) -> list[int]:
        """``count`` pages, each with refcount 1: free ones first, then the oldest evictable ones."""
        if count > self.free_pages:
            raise OutOfPagesError(f"{count} KV pages wanted but {self.free_pages} of {self.capacity} are free")
        pages = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        for page in pages:
            self.refcounts[page] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        self._remembered.discard(page)
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def remember(self, page: int) -> None:
        """The prefix cache keeps ``page`` (in use now): once nobody maps it, it waits as evictable."""
        if self.refcounts[page] < 1:
            raise ValueError(f"page {page} is free; only pages in use can be remembered")
        self._remembered.add(page)

    def retain(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages`` (a slot that shares them, or takes an evictable
        page back)."""
        for page in pages:
            if self.refcounts[page] < 1 and page not in self._evictable:
                raise ValueError(f"page {page} is free; only pages in use or evictable can be shared")
            self._evictable.pop(page, None)
            self.refcounts[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One reference fewer to each of ``pages``; a page nobody maps goes back to the free list
        (or waits as evictable when the prefix cache remembers it)."""
        for page in pages:
            if self.refcounts[page] < 1:
                raise ValueError(f"page {page} is released more often than it was taken")
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                if page in self._remembered:
                    self._evictable[page] = None
                else:
                    self._free.append(page)


class PageTable:
    """The slots' block tables (a device tensor, and the host's lists of each slot's pages)."""

    def __init__(self, pool: PagePool, max_slots: int, max_tokens: int, page_size: int,
                 device: torch.device | str):
        """``max_tokens``: the most entries a slot can hold (committed context and the widest scratch)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool, self.page_size = pool, page_size
        self.pages_per_slot = pages_for(max_tokens, page_size)
        self.device = torch.device(device)
        self.block_table = torch.full((max_slots, self.pages_per_slot), NULL_PAGE, dtype=torch.long,
                                      device=self.device)  # [max_slots, pages_per_slot]
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]

    @classmethod
    def fully_mapped(cls, max_slots: int, max_tokens: int, page_size: int, device: torch.device | str) -> PageTable:
        """A table whose every slot maps ``max_tokens`` entries from the start (a pool of exactly
        that many pages): a cache used without an allocator (tests, drafter training)."""
        table = cls(PagePool(max_slots * pages_for(max_tokens, page_size) + 1), max_slots, max_tokens, page_size,
                    device)
        table.ensure(range(max_slots), [max_tokens] * max_slots)
        return table

    @property
    def max_slots(self) -> int:
        return len(self._pages)

    def pages_of(self, slot: int) -> list[int]:
        return list(self._pages[slot])

    def ensure(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """Map pages so slot ``slots[i]`` holds at least ``tokens[i]`` entries; new table entries
        go to the device in one copy (queued behind earlier device work, see ``device_copy``)."""
        rows, cols, pages = [], [], []
        for slot, wanted in zip(slots, tokens):
            mapped = self._pages[slot]
            missing = pages_for(wanted, self.page_size) - len(mapped)
            if missing <= 0:
                continue
            if len(mapped) + missing > self.pages_per_slot:
                raise ValueError(f"slot {slot} would need {len(mapped) + missing} pages; a slot holds at most "
                                 f"{self.pages_per_slot} ({self.pages_per_slot * self.page_size} entries)")
            new = self.pool.allocate(missing)
            rows += [slot] * missing
            cols += range(len(mapped), len(mapped) + missing)
            pages += new
            mapped += new
        if pages:
            self._write(rows, cols, pages)

    def share(self, slot: int, pages: Sequence[int]) -> None:
        """Map ``pages`` (in use by other slots, or evictable) as the first pages of the empty ``slot``."""
        self.share_many([(slot, pages)])

    def share_many(self, mappings: Sequence[tuple[int, Sequence[int]]]) -> None:
        """:meth:`share` for each (slot, pages) of ``mappings``, the table entries sent in one copy."""
        rows, cols, mapped = [], [], []
        for slot, pages in mappings:
            if self._pages[slot]:
                raise ValueError(f"slot {slot} already maps {len(self._pages[slot])} pages; only an empty slot shares")
            self.pool.retain(pages)
            self._pages[slot] = list(pages)
            rows += [slot] * len(pages)
            cols += range(len(pages))
            mapped += pages
        if rows:
            self._write(rows, cols, mapped)

    def release(self, slots: Sequence[int]) -> None:
        """Unmap every page of ``slots`` (back to the pool unless another slot shares them)."""
        rows, cols = [], []
        for slot in slots:
            mapped = self._pages[slot]
            self.pool.release(mapped)
            rows += [slot] * len(mapped)
            cols += range(len(mapped))
            self._pages[slot] = []
        if rows:
            self._write(rows, cols, [NULL_PAGE] * len(rows))

    def _write(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        index = to_device(torch.tensor([rows, cols, pages], dtype=torch.long), self.device)  # [3, K]
        self.block_table[index[0], index[1]] = index[2]
