"""Start-up warm-up: the kernels of the prefill steps first requests bring, compiled before serving (issue #39).

Triton compiles a kernel once per specialization, the first time a launch needs it: per constexpr (the exact
mode's products pick their tile by row count, its attention a tile by new tokens per row) and per integer
argument that is 1, a multiple of 16, or neither. Start-up captures the rounds' CUDA graphs, which compiles
the rounds' kernels; prefill steps run eagerly, in a width and a row count the requests decide, so without a
warm-up the first requests of a process pay for those compiles (about a second each with an empty Triton cache).

The engine runs, before it makes its page pool, a prefill step of each (width, rows) of :func:`warm_up_steps`
on the pad slot of a provisional cache, as its memory profile does (``engine/memory_profile.py``); the
results are thrown away and the real cache never holds them.

Glossary: a step's *width* is the prompt tokens per row (rows are padded to the widest), its *rows* the
requests it prefills together; the products of a step have rows x width rows.
"""

from __future__ import annotations


def warm_up_widths(longest: int) -> list[int]:
    """Prompt-chunk widths that meet each class a launch specializes on, up to ``longest`` (the prefill chunk):
    1, 2, 3, every power of two from 4 with its two neighbours (the kernels' tile tables switch at powers
    of two, and each multiple of 16 sits between two widths that are not), and ``longest`` itself."""
    if longest < 1:
        raise ValueError(f"warm_up_widths: longest must be >= 1, got {longest}")
    widths = {1, 2, 3, longest}
    power = 4
    while power <= longest:
        widths |= {power - 1, power, power + 1}
        power *= 2
    return sorted(width for width in widths if width <= longest)


def warm_up_rows(width: int, max_rows: int, max_tokens: int) -> list[int]:
    """Row counts of the warm-up steps of ``width``: 1, 2 and the most a prefill step of ``max_tokens`` prompt
    tokens holds (at most ``max_rows``, the running requests)."""
    most = max(1, min(max_rows, max_tokens // width))
    return sorted({1, min(2, most), most})


def warm_up_steps(longest: int, max_rows: int, max_tokens: int) -> list[tuple[int, int]]:
    """(width, rows) of every warm-up prefill step, the most tokens first (the blocks the allocator caches for
    it then serve every narrower step)."""
    steps = [(width, rows) for width in warm_up_widths(longest) for rows in warm_up_rows(width, max_rows, max_tokens)]
    return sorted(steps, key=lambda step: step[0] * step[1], reverse=True)
