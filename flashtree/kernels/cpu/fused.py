"""The fused small ops of a decoder layer and short attention on the CPU (fp32): the CPU backend of
:mod:`flashtree.kernels.fused_ops`.

On a 2-core CPU each small torch op between the matmuls costs 15-30 us of dispatch and cache misses
for a few hundred floats of work; these are C++ loops in the kernel library (``library.py``: it
needs AVX-512 or AVX2 and a C++ compiler). :func:`tree_attention` serves every decode and verification forward, and prompt chunks of at most
:data:`MAX_KERNEL_PREFILL_TOKENS` tokens per row (longer ones keep SDPA's blocked kernel). Each token's sums
run in the same order whatever else is in the call, so a token's result does not depend on its batch or
on how many tree nodes share its forward; the order differs from torch's, so results differ from the
torch ops by float rounding.
"""


from __future__ import annotations

import functools

import torch

from flashtree.kernels.cpu import quant_linear
from flashtree.kernels.cpu.library import KernelUnavailable, load_kernels
from flashtree.kernels.fused_ops import qkv_write_operands, torch_rms_norm


@functools.cache
def available() -> bool:
    """The kernel library builds and loads on this machine."""
    try:
        load_kernels()
    except KernelUnavailable:
        return False
    return True


def usable_on(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and available()


def _ptr(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.data_ptr()


ADD_RMS_NORM_COPIES = False  # add_rms_norm takes no ``copy_to``: the caller writes the copy
EXACT = False  # a fast backend: a row's arithmetic may depend on the forward's shape
linear = quant_linear.linear  # the layers' products
rms_norm = torch_rms_norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual ``[..., width]`` -> (rms_norm(x + residual) * weight, x + residual)."""
    x, residual = x.contiguous(), residual.contiguous()
    total, normed = torch.empty_like(x), torch.empty_like(x)
    width = x.shape[-1]
    load_kernels().flashtree_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), total.data_ptr(),
                                          normed.data_ptr(), x.numel() // width, width, eps)
    return normed, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[..., 2 * width]`` (gate first) -> ``silu(gate) * up`` ``[..., width]``."""
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    load_kernels().flashtree_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width), width)
    return out


def moe_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse-MoE router (kernels.cpp ``flashtree_moe_route``): x ``[T, H]`` and the router's weight ``[E, H]``,
    float32 -> (weights ``[T, k]`` float32, expert ids ``[T, k]`` int64, most probable first): softmax over the
    experts, the k most probable, renormalized to sum 1 when ``normalize``. A row's routing never depends on T."""
    x, gate = x.contiguous(), gate.contiguous()
    ids = torch.empty(x.shape[0], top_k, dtype=torch.int64)
    weights = torch.empty(x.shape[0], top_k, dtype=torch.float32)
    load_kernels().flashtree_moe_route(x.data_ptr(), gate.data_ptr(), ids.data_ptr(), weights.data_ptr(), x.shape[0],
                                       gate.shape[0], x.shape[1], top_k, int(normalize), torch.get_num_threads())
    return weights, ids


def moe_layer(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A sparse-MoE layer's MLP on x ``[T, H]`` float32 (kernels.cpp ``flashtree_moe_layer``: :func:`moe_route`, then
    ``flashtree_moe_experts``); ``table``: the layer's ``[6]`` int64 (``SparseMoE.kernel_table``)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if load_kernels().flashtree_moe_layer(x.data_ptr(), table.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                          torch.get_num_threads()):
        raise ValueError(f"the MoE kernel refused {x.shape[0]} rows of {x.shape[1]}")
    return out


def qkv_norm_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None, eps: float,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """As :func:`flashtree.kernels.gpu.fused.qkv_norm_rope_write`: q/k norm + rotary, K/V into the cache; returns
    q ``[B, H, N, D]``."""
    qkv, q, slots, entries = qkv_write_operands(qkv, heads, kv_heads, k_cache, v_cache, write_index)
    b, n, _ = qkv.shape
    head_dim = q.shape[-1]
    if head_dim > 1024:
        raise ValueError(f"qkv_norm_rope_write needs head_dim <= 1024, got {head_dim}")
    positions = positions.contiguous()
    qk_norm = None if qk_norm is None else qk_norm.contiguous()  # (held: the kernel reads it)
    load_kernels().flashtree_qkv_rope_write(
        qkv.data_ptr(), _ptr(qk_norm), cos_table.data_ptr(),
        sin_table.data_ptr(), positions.data_ptr(), slots.data_ptr(), entries.data_ptr(), q.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), b * n, n, heads, kv_heads, head_dim, eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    return q


MAX_KERNEL_PREFILL_TOKENS = 32  # longer prompt chunks keep SDPA's blocked kernel (every mode prefills alike)


def handles_attention(new_tokens: int, prefill: bool = False) -> bool:
    """:func:`tree_attention` serves every forward that is not a prompt chunk, whatever its width: a tree
    node of any tree must get the bits plain decoding computes (SDPA's blocked kernel sums in an order set
    by the query count); prompt chunks of at most :data:`MAX_KERNEL_PREFILL_TOKENS` tokens too."""
    return not prefill or new_tokens <= MAX_KERNEL_PREFILL_TOKENS


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   slots: torch.Tensor, lengths: torch.Tensor, new_mask: torch.Tensor,
                   window: int | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`flashtree.kernels.gpu.attention.tree_attention` (in C++, one task per row and head on torch's threads):
    q ``[B, H, N, D]`` over each row's committed cache entries and the new tokens its ``new_mask``
    allows, read through the block table. A query's result is bit-identical whatever shares the
    call: a tree node gets exactly what plain decoding computes once its ancestors are committed. ``counts``
    (a packed forward's real tokens per row) is accepted and not used: every query is computed."""
    b, heads, n, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("tree_attention needs heads divisible by kv heads and matching cache views")
    q, slots, lengths, block_table = q.contiguous(), slots.contiguous(), lengths.contiguous(), block_table.contiguous()
    mask = new_mask.contiguous().view(torch.uint8)
    out = torch.empty_like(q)
    load_kernels().flashtree_tree_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), slots.data_ptr(),
        lengths.data_ptr(), mask.data_ptr(), out.data_ptr(), b, n, heads, kv_heads, head_dim, window or 0,
        head_dim ** -0.5, block_table.shape[1], page_size, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        torch.get_num_threads())
    return out
