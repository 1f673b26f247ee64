"""Memory for a model's GGUF blocks in transparent huge pages (Linux), so a CPU decode step streams its
weights through 2 MiB pages instead of 4 KiB ones.

A decode step reads every weight block once: SmolLM2-135M's Q4_1 blocks are ~80 MiB, 20,000 pages of
4 KiB, far more than the TLB holds, so each step walks page tables all along its streams. Where the
kernel hands out huge pages on request (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise`` or ``always``), one anonymous mapping for all blocks, aligned to 2 MiB and marked
``MADV_HUGEPAGE`` before it is touched, makes that 40 pages. The blocks are carved from it at 64-byte
offsets; they keep the mapping alive, and it is unmapped when the last of them goes. Elsewhere (another
OS, THP off, a small total) the blocks are ordinary tensors: same values, same products.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64 with 4 KiB base pages)
ALIGN = 64  # bytes: each carved tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """The OS hands out transparent huge pages to a mapping that asks (``always`` or ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class BlockArena:
    """uint8 tensors of the byte ``sizes`` to come, carved in order (:meth:`take`); in huge pages where
    available and worth it (at least one huge page in all), else each tensor is allocated on its own."""

    def __init__(self, sizes: list[int]):
        self._memory: torch.Tensor | None = None  # [capacity] uint8, 2 MiB aligned
        self._used = 0
        capacity = sum(_aligned(size) for size in sizes)
        if capacity >= HUGE_PAGE and huge_pages_available():
            mapping = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mapping.madvise(mmap.MADV_HUGEPAGE)  # (before any page of it is touched)
            whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
            start = -whole.data_ptr() % HUGE_PAGE
            self._memory = whole[start:start + capacity]

    @property
    def huge(self) -> bool:
        return self._memory is not None

    def take(self, rows: int, row_bytes: int) -> torch.Tensor:
        """An uninitialized uint8 ``[rows, row_bytes]`` tensor."""
        size = rows * row_bytes
        if self._memory is None or self._used + size > self._memory.numel():
            return torch.empty(rows, row_bytes, dtype=torch.uint8)
        out = self._memory[self._used:self._used + size].view(rows, row_bytes)
        self._used += _aligned(size)
        return out
