"""llama.cpp's row order of q/k projections, and how to undo it.

For the ``llama`` architecture, llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k``
(per head, from "first half / second half" rotary pairs to interleaved pairs); Qwen2/Qwen3 are not
permuted. Both the dequantized weights and the raw quantized blocks (whole blocks move with their
rows) are put back in Hugging Face's order here.
"""

from __future__ import annotations

import numpy as np

ROTARY_PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp permutes q/k rows only for these


def unpermute_rotary_rows(array: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for one projection (weight or bias).

    llama.cpp maps the rows of each head from [pairs: first half | second half] to
    interleaved pairs: reshape (n_head, 2, head_dim/2, ...) -> swap axes 1, 2. The inverse
    reads the rows as (n_head, head_dim/2, 2, ...) and swaps them back."""
    half = array.shape[0] // n_head // 2
    heads = array.reshape(n_head, half, 2, *array.shape[1:])
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(array.shape)


def unpermute_for_hf(gguf_name: str, array: np.ndarray, architecture: str, heads: int, kv_heads: int
                     ) -> np.ndarray:
    """``array`` (rows first: dequantized values, or raw quantized blocks that move with their
    rows) in Hugging Face's row order: q/k projections of the architectures llama.cpp permutes
    are un-permuted, everything else is returned as it is."""
    if architecture not in ROTARY_PERMUTED_ARCHITECTURES:
        return array
    if ".attn_q." in gguf_name:
        return unpermute_rotary_rows(array, heads)
    if ".attn_k." in gguf_name:
        return unpermute_rotary_rows(array, kv_heads)
    return array
