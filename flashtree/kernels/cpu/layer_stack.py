"""Every decoder layer of a short CPU forward in one call into the kernel library.

A CPU decode step of a small GGUF model runs, per layer, four block products and five fused small
ops; called one by one from Python, each pays dispatch and argument marshalling (about 90 us a layer
on a 2-core EPYC for SmolLM2-135M, a quarter of the step). :class:`LayerStack` hands the whole stack
to ``flashtree_layer_stack`` (``kernels.cpp``), which calls the same C++ functions with the same
operands in the same order: the results are bit-identical to the per-op path's. It serves the
forwards that attend with the C++ attention (:func:`~flashtree.kernels.cpu.fused.handles_attention`: decode
and verification forwards, padded or packed (models/packing.py), short prompt chunks; any number of rows)
of models whose every layer holds GGUF blocks; a sparse-MoE layer runs its router and routed experts
with the function its per-op path calls (``flashtree_moe_layer``).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from flashtree.kernels.cpu.library import load_kernels
from flashtree.kernels.cpu.quant_linear import QuantizedLinear

if TYPE_CHECKING:
    from flashtree.models.packing import TokenPacking

LAYER_FIELDS = 12  # int64 fields per layer in the table the kernel reads (kernels.cpp)
MOE_LAYER = -1  # a MoE layer's gate-up code in that table; its next field is the address of its MoE table


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the stack reads them."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qk_norm: torch.Tensor | None  # [2, head_dim]: q's weight, then k's (Qwen3), or None
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) * D] (Qwen2), or None
    qkv: QuantizedLinear
    o: QuantizedLinear
    gate_up: QuantizedLinear | None  # (None in a MoE layer)
    down: QuantizedLinear | None
    moe: torch.Tensor | None = None  # a MoE layer's table (``SparseMoE.kernel_table``), else None


class LayerDims(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # the layer norms'
    qk_eps: float  # the q/k norms' (0.0 without them)


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class LayerStack:
    """The stack of ``layers`` (see the module docstring); holds the weights' table for the kernel."""

    def __init__(self, layers: Sequence[LayerWeights], dims: LayerDims):
        self.dims = dims
        self._held = [t.contiguous() if t is not None else None for w in layers
                      for t in (w.input_norm, w.post_norm, w.qk_norm, w.qkv_bias)]  # alive while the table is
        rows = []
        for i, w in enumerate(layers):
            input_norm, post_norm, qk_norm, qkv_bias = self._held[4 * i:4 * i + 4]
            mlp = ([MOE_LAYER, w.moe.data_ptr(), 0, 0] if w.moe is not None else
                   [w.gate_up.kernel_code, w.gate_up.kernel_operand, w.down.kernel_code, w.down.kernel_operand])
            rows.append([_address(input_norm), _address(post_norm), _address(qk_norm), _address(qkv_bias),
                         w.qkv.kernel_code, w.qkv.kernel_operand, w.o.kernel_code, w.o.kernel_operand, *mlp])
        self._quants = [(w.qkv, w.o, w.gate_up, w.down, w.moe) for w in layers]  # their blocks stay alive
        self.table = torch.tensor(rows, dtype=torch.int64)  # [L, LAYER_FIELDS]
        self.num_layers = len(rows)
        self._dims = torch.tensor([dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.intermediate],
                                  dtype=torch.int64)
        self._scale = dims.head_dim ** -0.5
        self._run = load_kernels().flashtree_layer_stack

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, captures: dict[int, torch.Tensor],
                 rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                 write_index: tuple[torch.Tensor, torch.Tensor], storage: torch.Tensor, block_table: torch.Tensor,
                 slots: torch.Tensor, lengths: torch.Tensor, new_mask: torch.Tensor,
                 capture_rows: torch.Tensor | None = None, packing: TokenPacking | None = None) -> torch.Tensor:
        """Run every layer. h, residual ``[B, N, hidden]``: layer 0's normed input and its input
        (``residual`` is updated in place to the last layer's residual); ``captures``: layer l >= 1
        -> an ``[R, hidden]`` float tensor (unit column stride, one row stride for all) whose row
        ``capture_rows[t]`` (``[B * N]`` long; default t) receives token t's input to layer l
        (a column slice of the drafter's lag buffer, or a ``[B * N, hidden]`` tensor of its own);
        ``rope``: the whole cos, sin tables ``[P, D]``; ``write_index``: (page, offset) ``[B, N]`` of
        the new entries; ``storage``: the cache's ``[layers, 2, pages, KVH, page_size, D]``. Returns
        the last layer's MLP output. With ``packing`` (models/packing.py) h, residual, the captures and
        the output hold the ``[1, T, hidden]`` packed tokens; positions, write_index and new_mask stay
        ``[B, N]``."""
        b, n, hidden = h.shape
        if b * n == 0 or hidden != self.dims.hidden or not residual.is_contiguous():
            raise ValueError(f"the layer stack takes contiguous [B, N, {self.dims.hidden}] inputs, got {list(h.shape)}")
        rows, width = (b, n) if packing is None else packing.flat_of.shape
        if packing is not None and (b != 1 or n != packing.total or positions.shape != (rows, width)):
            raise ValueError(f"a packed forward's inputs are [1, {packing.total}, hidden] with [{rows}, {width}] "
                             f"positions, got {list(h.shape)} and {list(positions.shape)}")
        h = h.contiguous().clone()  # the kernel writes each layer's normed input into it
        out = torch.empty_like(h)
        capture, stride, limit = self._capture_targets(captures, b * n)
        if capture_rows is not None:
            capture_rows = capture_rows.contiguous()
            if capture_rows.dtype != torch.int64 or capture_rows.numel() != b * n:
                raise ValueError(f"capture_rows must be {b * n} int64 rows, got {capture_rows.numel()} "
                                 f"{capture_rows.dtype}")
        pages, offsets = (t.contiguous() for t in write_index)
        positions, slots, lengths = positions.contiguous(), slots.contiguous(), lengths.contiguous()
        block_table, mask = block_table.contiguous(), new_mask.contiguous().view(torch.uint8)
        flat_of, padded_of = (None, None) if packing is None else (packing.flat_of.contiguous(),
                                                                   packing.padded_of.contiguous())
        k_cache, v_cache = storage[0, 0], storage[0, 1]
        status = self._run(
            self.table.data_ptr(), self.num_layers, self._dims.data_ptr(), self.dims.eps, self.dims.qk_eps,
            self._scale, h.data_ptr(), residual.data_ptr(), out.data_ptr(), capture, _address(capture_rows), stride,
            limit, rope[0].data_ptr(),
            rope[1].data_ptr(), positions.data_ptr(), pages.data_ptr(), offsets.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), storage.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.data_ptr(), slots.data_ptr(), lengths.data_ptr(), mask.data_ptr(), block_table.shape[1],
            k_cache.shape[2], rows, width, torch.get_num_threads(), _address(flat_of), _address(padded_of),
            0 if packing is None else packing.total)
        if status == 2:
            raise ValueError(f"capture_rows holds a row outside the captures' {limit} rows")
        if status:
            raise ValueError("the layer stack's kernel refused its operands (a block type or row count)")
        return out

    def _capture_targets(self, captures: dict[int, torch.Tensor], tokens: int) -> tuple[ctypes.Array, int, int]:
        """The kernel's per-layer capture addresses, their common row stride and row count."""
        stride, limit = self.dims.hidden, tokens
        if captures:
            first = next(iter(captures.values()))
            stride, limit = first.stride(0), first.shape[0]
            for layer, target in captures.items():
                if (target.dtype != torch.float32 or target.dim() != 2 or target.shape != (limit, self.dims.hidden)
                        or target.stride() != (stride, 1) or not 1 <= layer < self.num_layers):
                    raise ValueError(f"capture of layer {layer}: want float32 [{limit}, {self.dims.hidden}] with "
                                     f"strides ({stride}, 1) for a layer in 1..{self.num_layers - 1}, got "
                                     f"{target.dtype} {list(target.shape)} strides {target.stride()}")
        addresses = (ctypes.c_void_p * self.num_layers)(*[captures[l].data_ptr() if l in captures else None
                                                          for l in range(self.num_layers)])
        return addresses, stride, limit
