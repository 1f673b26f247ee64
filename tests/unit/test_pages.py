"""KV pages: the pool's reference counts, block tables mapped and unmapped on the device, and the
paged cache's write / read / commit against a plain per-slot reference, with each slot's pages
scattered over the pool."""

from __future__ import annotations

import pytest
import torch

from flashtree.config import CacheConfig, SchedulerConfig
from flashtree.engine.request import Request
from flashtree.engine.scheduler import PageBudget, Scheduler
from flashtree.errors import RequestError
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.kv.pages import NULL_PAGE, OutOfPagesError, PagePool, PageTable
from flashtree.sampling import SamplingParams


def test_pool_hands_out_pages_and_takes_them_back_by_refcount():
    pool = PagePool(5)
    assert pool.capacity == 4 and pool.free_pages == 4
    first = pool.allocate(3)
    assert NULL_PAGE not in first and len(set(first)) == 3 and pool.used_pages == 3
    pool.retain(first[:1])  # shared by a second slot
    pool.release(first)
    assert pool.free_pages == 3  # the shared page stays in use
    pool.release(first[:1])
    assert pool.free_pages == 4
    with pytest.raises(OutOfPagesError, match="5 KV pages wanted but 4 of 4 are free"):
        pool.allocate(5)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(first[:1])
    with pytest.raises(ValueError, match="only pages in use or evictable"):
        pool.retain(first[:1])


def test_table_maps_on_demand_and_unmaps_to_the_null_page():
    table = PageTable(PagePool(10), max_slots=3, max_tokens=20, page_size=4, device="cpu")
    assert table.pages_per_slot == 5
    table.ensure([2, 0], [5, 1])  # slot 2 needs 2 pages, slot 0 one
    table.ensure([2], [8])  # already enough
    assert len(table.pages_of(2)) == 2 and len(table.pages_of(0)) == 1
    assert table.block_table[2, :2].tolist() == table.pages_of(2)
    assert table.block_table[2, 2:].eq(NULL_PAGE).all() and table.block_table[1].eq(NULL_PAGE).all()
    table.ensure([0], [13])
    assert table.block_table[0, :4].tolist() == table.pages_of(0) and table.pool.used_pages == 6
    table.release([0])
    assert table.block_table[0].eq(NULL_PAGE).all() and table.pool.used_pages == 2 and table.pages_of(0) == []
    with pytest.raises(ValueError, match="slot 1 would need 6 pages; a slot holds at most 5"):
        table.ensure([1], [21])


def _scattered_cache(page_size: int) -> KVCache:
    """A cache of 3 slots whose pages interleave (slot 1's first page comes after slot 0's ...)."""
    spec = KVCacheSpec(num_layers=2, max_slots=3, max_context=12, scratch=6, kv_heads=2, head_dim=4,
                       page_size=page_size)
    table = PageTable(PagePool(3 * 18 + 1), spec.max_slots, spec.capacity, page_size, "cpu")
    for tokens in range(1, spec.capacity + 1):  # one position at a time, slot by slot: pages interleave
        table.ensure([2, 0, 1], [tokens] * 3)
    return KVCache(spec, torch.float32, "cpu", table)


@pytest.mark.parametrize("page_size", [1, 4, 7, 18])
def test_paged_cache_writes_reads_and_commits_like_a_dense_one(page_size):
    cache = _scattered_cache(page_size)
    gen = torch.Generator().manual_seed(page_size)
    dense = torch.zeros(2, 2, 3, 2, cache.spec.capacity, 4)  # [layers, k/v, slots, KVH, positions, D]
    slots, starts = torch.tensor([2, 0]), torch.tensor([3, 5])
    for layer in range(2):
        k, v = torch.randn(2, 2, 2, 9, 4, generator=gen).unbind(0)  # [B, KVH, N, D] each
        cache.write(layer, slots, starts, k, v)
        for b, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist())):
            dense[layer, 0, slot, :, start:start + 9] = k[b]
            dense[layer, 1, slot, :, start:start + 9] = v[b]
    for layer in range(2):
        keys, values = cache.view(layer, slots, 14)
        assert torch.equal(keys, dense[layer, 0, slots, :, :14]) and torch.equal(values, dense[layer, 1, slots, :, :14])
    keep = torch.tensor([[0, 2, 3, 6], [0, 4, 0, 0]])  # a tree path per row, padded past its count
    counts = torch.tensor([4, 2])
    cache.commit(slots, starts, keep, counts)
    for b, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist())):
        moved = dense[:, :, slot, :, start + keep[b]].clone()
        dense[:, :, slot, :, start:start + 4] = moved
        n = int(counts[b])
        assert torch.equal(cache.view(0, slots[b:b + 1], start + n)[0][0], dense[0, 0, slot, :, :start + n])
        assert torch.equal(cache.view(1, slots[b:b + 1], start + n)[1][0], dense[1, 1, slot, :, :start + n])
    assert cache.lengths[slots].tolist() == [7, 7]


def _request(prompt: int, max_tokens: int) -> Request:
    return Request(prompt_ids=[1] * prompt, params=SamplingParams(max_tokens=max_tokens))


def test_admission_waits_for_pages_in_order_and_refuses_what_never_fits():
    budget = PageBudget(capacity=10, page_size=4, span=3)  # need = ceil((min(p + m, 64) + 3) / 4)
    scheduler = Scheduler(SchedulerConfig(max_running=8), CacheConfig(max_context=64), budget)
    first, second, third = _request(10, 11), _request(5, 8), _request(1, 1)  # 6, 4 and 2 pages
    for req in (first, second, third):
        scheduler.add(req)
    step = scheduler.schedule()
    assert step.prefill == [first, second] and scheduler.promised == 10  # the third waits: FIFO, no skipping
    first.status = second.status = type(first.status).FINISHED
    scheduler.release_finished()
    assert scheduler.promised == 0
    assert scheduler.schedule().prefill == [third] and scheduler.promised == 2
    with pytest.raises(RequestError, match="may reach 11 KV pages of 4 tokens .* the pool holds 10"):
        scheduler.add(_request(30, 11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_storage_is_zeros_that_take_memory_when_written(dtype):
    """The CPU storage reads as zeros, takes writes like any tensor, and is resident only where written
    (it outlives the memory map's Python object: the tensor holds it)."""
    def resident_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    spec = KVCacheSpec(num_layers=4, max_slots=64, max_context=4096, scratch=16, kv_heads=4, head_dim=64)
    before = resident_kib()
    cache = KVCache(spec, dtype, "cpu")  # 4 x 2 x 16k pages x 16 x 4 x 64: 1 GiB in float32
    assert cache.storage.dtype == dtype and cache.storage.shape == (4, 2, cache.pages.pool.num_pages, 4, 16, 64)
    assert not cache.storage[:, :, :4].any()
    cache.k[1][3, :, 5] = 1.5
    assert cache.storage[1, 0, 3, :, 5].eq(1.5).all() and cache.storage.sum() == 1.5 * 4 * 64
    assert resident_kib() - before < 64 * 1024  # (the whole of it would be 512-1024 MiB)
