"""KVCache.commit on the CPU (the per-row moves of ``_commit_moves_on_host``) against an entry-by-entry
oracle of its rule: entry ``starts[b] + max(keep[b, j], 0)`` of slot ``slots[b]`` moves to
``starts[b] + j`` for every j (sources read before any write), the rest of the storage unchanged."""

from __future__ import annotations

import pytest
import torch

from flashtree.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=3, max_slots=6, max_context=16, scratch=9, kv_heads=2, head_dim=4)


def oracle(storage: torch.Tensor, slots, starts, keep) -> torch.Tensor:
    out = storage.clone()
    for slot, start, kept in zip(slots.tolist(), starts.tolist(), keep.tolist()):
        for j, k in enumerate(kept):
            out[:, :, slot, :, start + j] = storage[:, :, slot, :, start + max(k, 0)]
    return out


def random_commit(generator: torch.Generator, rows: int, width: int):
    """Rows of increasing kept indices at or past their place (a tree's accepted path: nodes are laid
    out by depth), some in place from the start, padded with -1 past a random count."""
    slots = torch.randperm(SPEC.max_slots, generator=generator)[:rows]
    starts = torch.randint(0, SPEC.max_context, (rows,), generator=generator)
    keep, counts = [], []
    for _ in range(rows):
        count = int(torch.randint(1, width + 1, (1,), generator=generator))
        kept = sorted(torch.randperm(SPEC.scratch, generator=generator)[:count].tolist())
        if torch.rand(1, generator=generator).item() < 0.3:
            kept = list(range(count))  # a chain-like path: nothing moves
        keep.append(kept + [-1] * (width - count))
        counts.append(count)
    return slots, starts, torch.tensor(keep), torch.tensor(counts)


@pytest.mark.parametrize("seed", range(8))
def test_cpu_commit_moves_what_the_rule_says(seed: int):
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(SPEC, torch.float32, "cpu")
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=generator))
    slots, starts, keep, counts = random_commit(generator, rows=int(torch.randint(1, 5, (1,), generator=generator)),
                                                width=5)
    expected = oracle(cache.storage, slots, starts, keep)
    batched = cache.storage.clone()
    cache.commit(slots, starts, keep, counts)
    assert torch.equal(cache.storage, expected)
    assert cache.lengths[slots].tolist() == (starts + counts).tolist()
    cache.storage.copy_(batched)
    cache._commit_moves_batched(slots, starts, keep)  # the device path: the same rule
    assert torch.equal(cache.storage, expected)


def test_rows_sharing_a_slot_take_the_batch_wide_path():
    cache = KVCache(SPEC, torch.float32, "cpu")
    assert not cache._commit_moves_on_host(torch.tensor([1, 1]), torch.tensor([0, 0]), torch.tensor([[0, 2], [0, 2]]))
    assert cache._commit_moves_on_host(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([[0, 2], [0, 2]]))
