"""Paged KV cache with tree-capable append and commit.

Glossary
- slot: a running request's row in the block table (``0 .. max_slots-1``).
- position: an entry's place in its slot's sequence; position ``p`` lives on page
  ``block_table[slot, p // page_size]`` at offset ``p % page_size`` (``kv/pages.py``).
- committed length: positions ``[0, length)`` of a slot hold the K/V of tokens that are part of
  the request's accepted text.
- scratch entries: a forward writes the K/V of its N new tokens at positions
  ``length .. length+N-1`` whatever their logical positions or mask (a chain, a tree, padding).
  They are not committed until :meth:`KVCache.commit` moves a chosen subset to
  ``length .. length+k-1``.

All layers live in one tensor ``[layers, 2 (k/v), num_pages, kv_heads, page_size, head_dim]`` so a
commit moves every layer's entries with one gather and one scatter (zeros at first; on the CPU a page
of memory takes room only once a request writes into it, :func:`zeros`); ``k[layer]`` / ``v[layer]``
are ``[num_pages, kv_heads, page_size, head_dim]`` views. Kernels write through (page, offset)
pairs (:meth:`KVCache.write_index`) and read through the block table. Lengths live on the device
(``lengths``); the engine keeps its own host copy. Several caches (the target's and the drafter's)
can share one :class:`~flashtree.kv.pages.PageTable`: a page id then names the same positions in
each, and one mapping serves both.
"""

from __future__ import annotations

import dataclasses
import math
import mmap

import torch

from flashtree.kernels.gpu import tree as tree_kernels
from flashtree.kv.pages import PageTable, pages_for

DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    max_slots: int  # max running requests
    max_context: int  # committed tokens per request
    scratch: int  # max new tokens per forward beyond the committed context (tree size, chunk)
    kv_heads: int
    head_dim: int
    page_size: int = DEFAULT_PAGE_SIZE

    @property
    def capacity(self) -> int:
        """Positions a slot can hold."""
        return self.max_context + self.scratch

    def page_bytes(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.page_size * self.head_dim * elem

    def bytes(self, dtype: torch.dtype, num_pages: int | None = None) -> int:
        """Bytes of ``num_pages`` pages (default: every slot fully mapped, and the null page)."""
        if num_pages is None:
            num_pages = self.max_slots * pages_for(self.capacity, self.page_size) + 1
        return num_pages * self.page_bytes(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU in a private anonymous memory map, whose pages the kernel
    zeroes when first touched: pages nothing writes stay out of resident memory (a read maps the
    shared zero page), so a cache sized for many long requests costs what its requests use."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or not nbytes or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)  # (it keeps the map)


class KVCache:
    def __init__(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str,
                 pages: PageTable | None = None):
        """``pages``: the block tables to read and write through (shared with other caches, mapped
        by the engine as requests grow); None: a table of this cache's own with every slot fully
        mapped."""
        if pages is None:
            pages = PageTable.fully_mapped(spec.max_slots, spec.capacity, spec.page_size, device)
        if pages.page_size != spec.page_size or pages.max_slots < spec.max_slots:
            raise ValueError(f"the page table (page size {pages.page_size}, {pages.max_slots} slots) does not fit "
                             f"the cache (page size {spec.page_size}, {spec.max_slots} slots)")
        if pages.pages_per_slot * pages.page_size < spec.capacity:
            raise ValueError(f"the page table maps {pages.pages_per_slot * pages.page_size} positions per slot; "
                             f"the cache needs {spec.capacity}")
        self.spec, self.pages = spec, pages
        self.storage = zeros((spec.num_layers, 2, pages.pool.num_pages, spec.kv_heads, spec.page_size,
                              spec.head_dim), dtype, device)
        self.k = [self.storage[i, 0] for i in range(spec.num_layers)]
        self.v = [self.storage[i, 1] for i in range(spec.num_layers)]
        self.lengths = torch.zeros(spec.max_slots, dtype=torch.long, device=device)  # [max_slots]
        self.commit_kernel = False  # commit moves entries with tree_kernels.commit_entries (the engine's triton_tree)

    @property
    def block_table(self) -> torch.Tensor:
        return self.pages.block_table  # [max_slots, pages_per_slot]

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each position: ``slots [B]``, ``positions [B, N]`` -> ``[B, N]`` each."""
        size = self.spec.page_size
        return self.block_table[slots[:, None], positions // size], positions % size

    def write_index(self, slots: torch.Tensor, starts: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) ``[B, N]`` each: where a forward's N new entries per row go (positions
        ``starts[b] + i``)."""
        return self.locate(slots, starts[:, None] + torch.arange(n_new, device=starts.device))

    def write_at(self, layer: int, index: tuple[torch.Tensor, torch.Tensor],
                 k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the new entries at ``index`` (from :meth:`write_index`).

        k_new, v_new: ``[B, N, kv_heads, head_dim]``.
        """
        page_idx, offset_idx = index
        self.k[layer][page_idx, :, offset_idx] = k_new
        self.v[layer][page_idx, :, offset_idx] = v_new

    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write N new entries per row at ``starts[b] + i``; k_new, v_new: ``[B, kv_heads, N, head_dim]``."""
        index = self.write_index(slots, starts, k_new.shape[2])
        self.write_at(layer, index, k_new.transpose(1, 2), v_new.transpose(1, 2))

    def view(self, layer: int, slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, kv_heads, kv_len, head_dim]`` of the rows' slots, gathered page by page
        (positions past a slot's mapped pages read the null page: the caller masks them)."""
        pages = self.block_table[slots, :pages_for(kv_len, self.spec.page_size)]  # [B, P]
        return self._gather(self.k[layer], pages, kv_len), self._gather(self.v[layer], pages, kv_len)

    @staticmethod
    def _gather(layer_pages: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One copy, straight into ``[B, KVH, P * page_size, D]`` (cut to ``kv_len``)."""
        b, p = pages.shape
        _, heads, size, dim = layer_pages.shape
        head = torch.arange(heads, device=pages.device)[None, :, None]  # [1, KVH, 1]
        picked = layer_pages[pages[:, None, :], head]  # [B, KVH, P, page_size, D]
        return picked.view(b, heads, p * size, dim)[:, :, :kv_len]

    def commit(self, slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor,
               keep_counts: torch.Tensor) -> None:
        """Keep a subset of each row's scratch entries and make them committed.

        slots, starts: ``[B]`` (starts = committed length before this forward, where the
        scratch entries begin); keep: ``[B, P]`` indices into the row's new entries, in the
        order they must take, padded with anything past ``keep_counts[b]``; keep_counts: ``[B]``.
        Entry ``keep[b, j]`` moves to ``starts[b] + j``; everything else is dead. Lengths are set,
        not incremented, so running the same commit twice (CUDA-graph warm-up) is harmless.
        """
        if self.commit_kernel:  # the lengths too
            tree_kernels.commit_entries(self.storage, self.block_table, slots, starts, keep, keep_counts, self.lengths)
            return
        n_keep = keep.shape[1]
        src_page, src_offset = self.locate(slots, starts[:, None] + keep.clamp(min=0))  # [B, P] each
        dst_page, dst_offset = self.locate(slots, starts[:, None] + torch.arange(n_keep, device=keep.device))
        moved = self.storage[:, :, src_page, :, src_offset]  # [B, P, layers, 2, kv_heads, head_dim] (before writing)
        self.storage[:, :, dst_page, :, dst_offset] = moved
        self.lengths[slots] = starts + keep_counts

    def commit_prefix(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first ``counts[b]`` scratch entries where they are (chains: the accepted
        path is a prefix of the new entries, so nothing moves). Lengths are set, not incremented."""
        self.lengths[slots] = starts + counts

    def advance(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first ``counts[b]`` scratch entries in place (chains, prefill)."""
        self.lengths[slots] += counts

    def free(self, slots: torch.Tensor) -> None:
        self.lengths[slots] = 0
