"""Fused Triton kernels for the decoder's small per-layer ops on CUDA.

A decode step at batch 1 is a few large matmuls and, between them, dozens of tiny element-wise
kernels per layer (norms, rotary, residual adds, KV-cache writes); on an H200 those tiny kernels
cost about a third of the step (benchmarks/README.md). Three kernels replace them:

- :func:`add_rms_norm`: residual add + RMSNorm in one pass (returns both the sum and its norm);
- :func:`qkv_norm_rope_write`: from the fused qkv projection, per head: optional q/k RMSNorm,
  rotary at the token's position, and the K/V written straight into the KV cache; returns q in
  the ``[B, H, N, D]`` layout attention wants;
- :func:`silu_mul`: ``silu(gate) * up`` from the fused gate-up projection;
- :func:`tree_attention`: attention of each row's new tokens over its committed context and the
  new tokens its ``new_mask`` allows (a chain, a tree, a block), read straight from the KV cache
  by slot and length. Lengths are device tensors, so one CUDA graph serves every context length
  and slot layout (the SDPA path needs the longest context and a slot range in the graph key).
  Long contexts at small batch are split across programs and merged (flash-decoding);
- :func:`expand_levels`: DDTree's per-depth kept lists (``spec/tree.py``) for all depths in one
  kernel per row, instead of a dozen small kernels per depth;
- :func:`select_nodes`: the tree itself from those lists (best nodes over all depths, layout,
  parents, ancestor mask) in one kernel per row, instead of about fifty small kernels;
- :func:`accept_walk`: the accept walk (``spec/verify.py``) in one kernel per row.

Arithmetic is float32 inside each kernel with one rounding to the storage dtype at the end (the
unfused path rounds after every op), except that a q/k norm's result is rounded to the storage
dtype before rotary, as the reference models do. Every kernel treats tokens independently, so a
token's result does not depend on how many others share the batch.

Triton is optional: :func:`available` is False without it (the CPU wheel of torch does not bring
it) and the models keep their plain torch ops. ``TRITON_INTERPRET=1`` runs these kernels on CPU
tensors (tests use it).
"""

from __future__ import annotations

import importlib.util
import os

import torch


def available() -> bool:
    """Triton is installed (kernels can run on CUDA tensors, or anywhere when interpreting)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable_on(tensor: torch.Tensor) -> bool:
    """These kernels can run on ``tensor``'s device."""
    return available() and (tensor.is_cuda or interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
