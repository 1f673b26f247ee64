"""The fused small ops a decoder layer calls between its matmuls, and what both backends share.

A decode step at small batch is a few large matmuls and, between them, dozens of tiny element-wise
ops per layer (norms, rotary, residual adds, KV-cache writes, silu): each costs more in launches or
dispatch than in arithmetic. A backend fuses them: :mod:`flashtree.kernels.gpu.fused` (Triton, CUDA)
and :mod:`flashtree.kernels.cpu.fused` (C++, fp32 on a CPU). A model holds one backend module (or
None: plain torch ops) and calls the functions of :class:`FusedOps` on it.

Arithmetic is float32 inside each op with one rounding to the storage dtype at the end (except that
a q/k norm's result is rounded before rotary, as the reference models do), and every op treats
tokens independently, so a token's result does not depend on what else shares the call.
"""

from __future__ import annotations

from typing import Protocol

import torch

from flashtree.kernels.feature_sink import SinkSegment


class FusedOps(Protocol):
    ADD_RMS_NORM_COPIES: bool  # add_rms_norm writes ``copy_to`` itself (else the caller copies)
    EXACT: bool  # the exact backend: tree_attention takes the forward's ``key_order`` (kernels/gpu/exact.py)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               quant=None) -> torch.Tensor:
        """The layers' products: ``F.linear`` (from GGUF blocks where ``quant`` holds them)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight over the last dim (a norm with no residual to add)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     copy_to: SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual ``[..., width]`` -> (rms_norm(x + residual) * weight, x + residual)."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up ``[..., 2 * width]`` (gate first) -> ``silu(gate) * up`` ``[..., width]``."""

    def qkv_norm_rope_write(self, qkv: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None,
                            eps: float, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per head of the fused qkv projection ``[B, N, (H + 2 KVH) * D]``: the optional q/k norm,
        rotary at ``positions [B, N]``, K/V written into one layer's cache views at ``write_index``
        (page, offset ``[B, N]`` each); returns q ``[B, H, N, D]``."""

    def handles_attention(self, new_tokens: int, prefill: bool = False) -> bool:
        """:meth:`tree_attention` serves forwards of this many new tokens per row (a prompt chunk's: ``prefill``)."""

    def tree_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                       new_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """q ``[B, H, N, D]`` over row b's committed positions ``0 .. lengths[b]-1`` of slot
        ``slots[b]`` (the last ``window`` only, with a sliding window), read from one layer's
        ``[pages, KVH, page_size, D]`` cache views through ``block_table [slots, pages_per_slot]``,
        and the new tokens its ``new_mask [B, N, N]`` allows; returns ``[B, H, N, D]``."""


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:meth:`FusedOps.rms_norm` with torch's op (what RMSNorm modules compute)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def qkv_write_operands(qkv: torch.Tensor, heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       write_index: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Checked, contiguous operands of a qkv_norm_rope_write (either backend): qkv, the empty q
    ``[B, H, N, D]`` output, and the write slots and entries ``[B, N]``."""
    b, n, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    if head_dim % 2 or head_dim * (heads + 2 * kv_heads) != width:
        raise ValueError(f"qkv of width {width} does not hold {heads} + 2 x {kv_heads} heads of an even size")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must be views with the same strides and a contiguous last dim")
    slots, entries = (t.contiguous() for t in write_index)
    return qkv.contiguous(), qkv.new_empty(b, heads, n, head_dim), slots, entries
