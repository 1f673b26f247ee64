"""The fused small ops of a decoder layer on CUDA (the GPU backend of :mod:`flashtree.kernels.fused_ops`)."""

from __future__ import annotations

import functools

import torch

from flashtree.kernels.cpu import quant_linear
from flashtree.kernels.feature_sink import SinkSegment
from flashtree.kernels.fused_ops import qkv_write_operands, torch_rms_norm
from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2
from flashtree.kernels.gpu.attention import tree_attention  # noqa: F401 (part of the backend)


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_fused

    return triton_fused


ADD_RMS_NORM_COPIES = True  # add_rms_norm takes ``copy_to`` (the unfused path writes the copy itself)
EXACT = False  # a fast backend: a row's arithmetic may depend on the forward's shape
linear = quant_linear.linear  # the layers' products
rms_norm = torch_rms_norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 copy_to: SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual ``[..., width]`` -> (rms_norm(x + residual) * weight, x + residual); with
    ``copy_to`` (kernels/feature_sink.py) the sum of token t also goes to row ``copy_to.rows[t]``
    of ``copy_to.columns``, in the same kernel."""
    width = x.shape[-1]
    x, residual = x.contiguous(), residual.contiguous()
    total = torch.empty_like(x)
    normed = torch.empty_like(x)
    if copy_to is not None:
        columns, rows = copy_to.columns, copy_to.rows
        assert columns.stride(1) == 1 and rows.numel() == x.numel() // width, "copy_to: one row per token"
    else:
        columns, rows = x, x  # not read (COPY is off)
    _kernels()._add_rms_norm_kernel[(x.numel() // width,)](x, residual, weight, total, normed, width, eps,
                                                           columns, rows, columns.stride(0),
                                                           BLOCK=_next_power_of_2(width), COPY=copy_to is not None)
    return normed, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[..., 2 * width]`` (gate first) -> ``silu(gate) * up`` ``[..., width]``."""
    width = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    block = 1024
    _kernels()._silu_mul_kernel[(gate_up.numel() // (2 * width), -(-width // block))](gate_up, out, width, BLOCK=block)
    return out


def qkv_norm_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None, eps: float,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate q and k, write k and v into the cache; returns q ``[B, H, N, D]``.

    qkv: ``[B, N, (H + 2 KVH) * D]`` (q heads, then k heads, then v heads); qk_norm: ``[2, D]``, the
    q-norm then the k-norm weight, or None (no q/k norm); cos_table/sin_table: ``[P, D]`` (halves
    repeated, as :class:`~flashtree.models.rope.RotaryTable` stores them); positions: ``[B, N]`` rotary positions;
    k_cache/v_cache: one layer's ``[pages, KVH, page_size, D]`` views; write_index: (page, offset)
    ``[B, N]`` each, where each token's K/V go.
    """
    qkv, q, slots, entries = qkv_write_operands(qkv, heads, kv_heads, k_cache, v_cache, write_index)
    b, n, _ = qkv.shape
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1):
        raise ValueError(f"qkv_norm_rope_write needs a power-of-two head_dim, got {head_dim}")
    _kernels()._qkv_norm_rope_write_kernel[(b * n, heads + kv_heads)](
        qkv, qkv if qk_norm is None else qk_norm.contiguous(), cos_table, sin_table,
        positions.contiguous(), slots, entries, q, k_cache, v_cache,
        n, heads, kv_heads, eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HALF=head_dim // 2, QK_NORM=qk_norm is not None)
    return q


def handles_attention(new_tokens: int, prefill: bool = False) -> bool:
    """:func:`tree_attention` serves forwards of any width."""
    return True
