"""Triton kernels on CUDA, by concern:

- ``fused.py``: a decoder layer's small ops (residual add + RMSNorm, q/k norm + rotary + KV-cache
  write, silu * up), the GPU backend of :mod:`flashtree.kernels.fused_ops`;
- ``attention.py``: tree attention, each row's new tokens over its committed context and the new
  tokens its mask allows, read straight from the KV pages through the block table (lengths are
  device tensors, so one CUDA graph serves every context length; long contexts are split across
  programs and merged);
- ``tree.py``: DDTree's tree work, per-depth kept lists, node selection with the ancestor mask, the
  accept walk and the KV commit, one program per row instead of dozens of small kernels;
- ``topk.py``: the drafter logits' per-depth top-k with log-probabilities (an exact radix select);
- ``gemm.py``: a product whose rows are computed the same way whatever the row count (the exact
  mode's building block; not called by the engine yet);
- ``triton_*.py``: the ``@triton.jit`` kernels behind each, imported only when used.

Triton is optional: :func:`available` is False without it (the CPU wheel of torch does not bring
it) and the models keep their torch ops. ``TRITON_INTERPRET=1`` runs these kernels on CPU tensors
(the tests use it).
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
