"""The exact mode's kernel backend on CUDA (issue #29): every op of a target forward computes a token's result
the same way whatever else the forward holds, so a tree node, a chain token and a prompt token get bit for bit
what a plain decoding step computes at their position, at any batch size and in any dtype.

- products (every linear, the LM head included): :func:`~flashtree.kernels.gpu.gemm.invariant_linear`,
  one reduction order over K whatever the row count (an FP8 checkpoint's linears: their own FP8 product,
  row-invariant the same way, kernels/gpu/fp8_gemm.py);
- attention (prefill, decode, chain and tree alike): :func:`~flashtree.kernels.gpu.exact_attention.exact_attention`,
  each query over its logical keys in fixed blocks and fixed splits;
- norms, rotary, the KV write and silu * up: the fused backend's per-token Triton kernels (one program per
  token, or per token and head: nothing is shared between tokens), and RMSNorm without a residual through the
  same kernel (adding zeros is exact).

It is a module with the :class:`~flashtree.kernels.fused_ops.FusedOps` functions, like the fused backend.
"""

from __future__ import annotations

import torch

from flashtree.kernels.gpu.exact_attention import ancestor_order, exact_attention
from flashtree.kernels.gpu.fused import (  # noqa: F401
    ADD_RMS_NORM_COPIES,
    add_rms_norm,
    qkv_norm_rope_write,
    silu_mul,
)
from flashtree.kernels.gpu.gemm import invariant_linear

EXACT = True  # the forward needs each new token's ancestor order (key_order) for the attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, quant=None) -> torch.Tensor:
    """The row-invariant product, or ``quant``'s where it is row-invariant too (FP8 weights: fp8_gemm.py; GGUF
    blocks are a CPU format and are refused)."""
    if quant is not None:
        if not getattr(quant, "ROW_INVARIANT", False):
            raise ValueError("exact mode runs on CUDA weights, plain or FP8; GGUF blocks (a CPU format) are not "
                             "supported there")
        return quant(x, bias)
    return invariant_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight, one program per token."""
    return add_rms_norm(x, torch.zeros_like(x), weight, eps)[0]


def key_order(new_mask: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What :func:`tree_attention` needs of a forward's ``new_mask [B, N, N]``: None for causal chunks (prompt
    chunks), else :func:`ancestor_order`. Computed once per forward."""
    return None if causal else ancestor_order(new_mask)


def handles_attention(new_tokens: int, prefill: bool = False) -> bool:
    return True


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   slots: torch.Tensor, lengths: torch.Tensor, new_mask: torch.Tensor, window: int | None = None,
                   key_order: tuple[torch.Tensor, torch.Tensor] | None = None,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`exact_attention` with the forward's ``key_order`` (None: causal chains; ``new_mask`` is then
    not read). No sliding window: no target the engine runs has one. ``counts`` (a packed forward's real
    tokens per row) is accepted and not used: every query is computed."""
    if window:
        raise ValueError("exact mode does not support sliding-window attention")
    return exact_attention(q, k_cache, v_cache, block_table, slots, lengths, key_order)
