"""The blocks' memory (kernels/cpu/huge_pages.py): tensors carved from one huge-page mapping where the OS
offers transparent huge pages, each on its own cache line and apart from the others; ordinary tensors
otherwise. A GGUF model's holders come from it (their products are checked against fp32 weights in the
block-kernel tests)."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels.cpu import huge_pages
from flashtree.kernels.cpu.huge_pages import ALIGN, HUGE_PAGE, BlockArena


def test_tensors_carved_apart_and_aligned():
    sizes = [(3000, 1000), (1, 5), (700, 2048)]  # 3 MB in all, the middle one 5 bytes
    arena = BlockArena([r * c for r, c in sizes])
    tensors = [arena.take(r, c) for r, c in sizes]
    for i, ((rows, cols), t) in enumerate(zip(sizes, tensors)):
        assert t.shape == (rows, cols) and t.dtype == torch.uint8 and t.is_contiguous()
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())  # (no tensor overlaps another)
        if arena.huge:
            assert t.data_ptr() % ALIGN == 0
    if arena.huge:
        assert tensors[0].data_ptr() % HUGE_PAGE == 0


def test_past_its_sizes_or_without_huge_pages_it_hands_out_ordinary_tensors(monkeypatch):
    arena = BlockArena([HUGE_PAGE])
    arena.take(1, HUGE_PAGE)
    extra = arena.take(4, 4)  # (more than it was sized for)
    assert extra.shape == (4, 4)
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    assert not BlockArena([8 * HUGE_PAGE]).huge
    assert not BlockArena([1000]).huge  # (less than one huge page: not worth a mapping)


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="no transparent huge pages here")
def test_the_mapping_asks_for_huge_pages():
    assert BlockArena([4 * HUGE_PAGE]).huge
