"""CPU products straight from a GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q6_K).

A GGUF model is dequantized once to float32 for its layout (``models/gguf_convert.py``); on the CPU
in float32, every linear whose GGUF matrix is of a type in :data:`BLOCK_TYPES` computes all its products
from the blocks (``models/quantized_weights.py``) and keeps no fp32 weight: 0.56-1.06 bytes per weight
instead of 4, in memory and in what a decode step streams. The kernel (``kernels.cpp``) rebuilds each
weight in registers exactly as the converter stored it and accumulates in float32:

- Q4_1 / Q5_1: ``fma(d, q, m)``. ``d`` is an fp16 value and ``q`` a 4- or 5-bit integer, so ``d * q``
  is exact in fp32 and the fma rounds once, like numpy's ``d * q + m``.
- Q4_0 / Q5_0: ``fma(d, q, -8 d)`` (``-16 d``) = ``d * (q - 8)`` (``q - 16``) exactly (every term and
  the result are representable), as numpy's.
- Q8_0: ``d * q``, exact.
- Q4_K (256-weight super-blocks, read as 8 blocks of 32 with a 6-bit scale and min each):
  ``fma(d * sc, q, -(dmin * m))``: every product exact, one rounding, like gguf-py's ``(d sc) q - dmin m``.
- Q6_K (a signed 8-bit scale per 16 weights): ``(d * sc) * (q - 32)``, in gguf-py's order.

A fused product whose matrices have different types (Q4_K_M's q/k in Q4_K, v in Q6_K) is a
:class:`MixedQuantizedLinear`: each part computed by its own type's kernel.

so the weights are bit-identical to the fp32 ones (checked at load on a spread of rows of every
weight); only the summation order differs from MKL's. Each (row, output) sum runs over the blocks in
one order whatever the row count, so a row's result never depends on how many rows share the call
(a tree node gets what plain decoding computes). The rows go in groups of 8 (of 4 where 8 rows of x
would not fit in L1): each weight block is decoded once per group, and over the groups of a prefill
each thread's share of the weight stays in its L2 (at 512 rows 0.85x of MKL's fp32 speed on a 2-core
EPYC). The kernel prefetches 4 KB ahead in the weight stream: the per-layer products are too short
for the hardware prefetcher alone. :func:`embedding` rebuilds looked-up rows from the blocks
(bit-identical to the fp32 rows). :func:`quantize_q8_0` rounds a drafter's weights to Q8_0 blocks.
``--no-quant-kernels`` (``KernelConfig``) keeps the fp32 weights and products instead.

Int8 activations (``KernelConfig.int8_activations``, on by default for GGUF targets; off with
``--no-int8-activations``): like llama.cpp, the kernel first rounds each row of x per 32 values to
``q = round(x / d)`` with ``d = max|x| / 127`` (one float scale per block), then takes per block the
exact integer dot product of q with the weight block's integers (AVX-512 VNNI ``vpdpbusd``, else AVX2
``vpmaddubsw``; the same bits either way) and adds it, scaled by ``d`` and the block's scale, in float
(fixed order: the same for every row count). The result differs from the float product by at most
``sum over blocks of d / 2 * sum|w|`` plus float rounding (each x moves by at most ``d / 2``); the
decode step reads the weights at about twice the float path's speed, which is compute-bound.
"""


from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from flashtree.kernels.cpu.library import load_kernels


class BlockType(NamedTuple):
    """A GGUF block type the kernel reads: a row of K weights is K / weights blocks of ``block_bytes``."""

    weights: int  # per block: 32, or 256 for the k-quant super-blocks (read as 8 blocks of 32)
    block_bytes: int
    code: int  # the kernel's type code (kernels.cpp)
    int8: bool = True  # the kernel can take x as int8 blocks (int8 activations) with this type

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.weights * self.block_bytes


BLOCK_TYPES = {"Q4_0": BlockType(32, 18, 0), "Q4_1": BlockType(32, 20, 1), "Q8_0": BlockType(32, 34, 2),
               "Q5_0": BlockType(32, 22, 3), "Q5_1": BlockType(32, 24, 4),
               "Q4_K": BlockType(256, 144, 5), "Q6_K": BlockType(256, 210, 6)}
# Not a GGUF type: a float32 weight row read 32 values at a time, so that a dense float32 model's products have
# the block types' row-invariant arithmetic (F.linear's rows change bits with the row count: MKL picks its
# kernels by shape); see float32_rows. No int8 activations.
F32_ROWS = BlockType(32, 128, 7, int8=False)
KERNEL_TYPES = {**BLOCK_TYPES, "F32": F32_ROWS}
INT8_ACTIVATIONS = 16  # or-ed into the type code: the kernel quantizes x to int8 blocks first (kernels.cpp)
MIXED_PARTS = 32  # the code of a product whose parts have different types (MixedQuantizedLinear; kernels.cpp)


class QuantizedLinear:
    """One linear weight ``[N, K]`` kept as GGUF blocks (rows of ``K / 32`` blocks, or ``K / 256``
    super-blocks for Q4_K / Q6_K, raw bytes).

    Call it with a float32 CPU ``x [..., K]`` of any number of rows (and a contiguous float32
    ``bias [N]`` or None): ``x @ W.T (+ bias)`` ``[..., N]``. With ``int8_activations`` each row of x
    is first rounded to int8 per 32 values (one float scale per block, as llama.cpp does) and the
    products are integer block dot products: faster, and off from the float product by the rounding of x
    (see the module docstring); each row is rounded on its own, so a row's result still never depends
    on the rows beside it. The flag may be changed at any time; a :class:`LayerStack` reads
    :attr:`kernel_code` when it is built."""

    def __init__(self, type_name: str, blocks: torch.Tensor, in_features: int, int8_activations: bool = False):
        if type_name not in KERNEL_TYPES:
            raise ValueError(f"unsupported block type {type_name!r}; allowed: {', '.join(KERNEL_TYPES)}")
        block_type = KERNEL_TYPES[type_name]
        self.type_code, self.takes_int8 = block_type.code, block_type.int8
        if in_features % block_type.weights or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != block_type.row_bytes(in_features):
            raise ValueError(f"{type_name} blocks of shape {list(blocks.shape)} do not hold rows of {in_features} "
                             f"(rows of a multiple of {block_type.weights} weights, {block_type.block_bytes} "
                             f"bytes per {block_type.weights})")
        self.type_name = type_name
        self.int8_activations = int8_activations
        self.blocks = blocks.contiguous()
        self.out_features, self.in_features = blocks.shape[0], in_features
        self._lib = load_kernels()
        self._gemm = self._lib.flashtree_block_gemm
        self._blocks_ptr = self.blocks.data_ptr()

    @property
    def kernel_operand(self) -> int:
        """The address the kernel takes with :attr:`kernel_code`: the blocks'."""
        return self._blocks_ptr

    @property
    def kernel_code(self) -> int:
        """The product's code for the kernel: the block type, with :data:`INT8_ACTIVATIONS` where set (and the
        type takes them)."""
        return self.type_code | (INT8_ACTIVATIONS if self.int8_activations and self.takes_int8 else 0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"the block kernel takes float32 CPU rows of {self.in_features}, "
                             f"got {x.dtype} {x.device.type} {list(x.shape)}")
        x = x.contiguous()
        rows = x.numel() // self.in_features
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        status = self._gemm(self.kernel_code, x.data_ptr(), self._blocks_ptr,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                            self.out_features, self.in_features, torch.get_num_threads())
        if status:
            raise ValueError(f"block kernel refused {rows} rows of {self.in_features} ({self.type_name})")
        return y

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` (or its ``rows``) rebuilt by the kernel's own block decoding."""
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows).contiguous()
        out = torch.empty(blocks.shape[0], self.in_features, dtype=torch.float32)
        self._lib.flashtree_block_dequantize(self.type_code, blocks.data_ptr(), out.data_ptr(),
                                             blocks.shape[0], self.in_features, torch.get_num_threads())
        return out


class MixedQuantizedLinear(QuantizedLinear):
    """A fused weight ``[N, K]`` whose parts (row ranges, in order) are GGUF matrices of different types,
    e.g. Q4_K_M's q/k in Q4_K and v in Q6_K: one call, each part its own product of its type's kernel
    into its columns (a part's outputs are what the part alone gives). :attr:`blocks` holds every part's
    bytes (flat ``uint8``); the kernel reads the parts through a table (``MIXED_PARTS``, kernels.cpp)."""

    def __init__(self, parts: Sequence[QuantizedLinear], int8_activations: bool = False,
                 flat: torch.Tensor | None = None):
        """``flat``: where the parts' bytes go (uint8 ``[total bytes]``; default: a new tensor)."""
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a mixed product needs parts of one width, got "
                             f"{[(p.type_name, p.in_features) for p in parts]}")
        flat = torch.cat([p.blocks.reshape(-1) for p in parts], out=flat)  # [total bytes]: all parts, one storage
        self.parts, offset = [], 0
        for part in parts:
            view = flat[offset:offset + part.blocks.numel()].view(part.blocks.shape)
            self.parts.append(QuantizedLinear(part.type_name, view, part.in_features))
            offset += part.blocks.numel()
        self.type_name = "+".join(p.type_name for p in parts)
        self.type_code, self.takes_int8 = MIXED_PARTS, all(p.takes_int8 for p in self.parts)
        self.int8_activations = int8_activations
        self.blocks = flat
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self._lib = self.parts[0]._lib
        self._gemm = self._lib.flashtree_block_gemm
        self._table = torch.tensor([len(parts)] + [v for p in self.parts
                                                   for v in (p.type_code, p.blocks.data_ptr(), p.out_features)],
                                   dtype=torch.int64)  # [1 + 3 parts]
        self._blocks_ptr = self._table.data_ptr()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            return torch.cat([p.dequantize() for p in self.parts])
        out = torch.empty(rows.numel(), self.in_features, dtype=torch.float32)
        start = 0
        for part in self.parts:
            inside = (rows >= start) & (rows < start + part.out_features)
            if inside.any():
                out[inside] = part.dequantize(rows[inside] - start)
            start += part.out_features
        return out


def quantize_q8_0(weight: torch.Tensor) -> QuantizedLinear:
    """Q8_0 blocks of an fp32 weight ``[N, K]`` (K a multiple of 32), as GGUF writes them: per 32
    weights an fp16 scale ``d = max|w| / 127`` and ``q = round(w / d)``. Lossy (about 0.4% of a
    block's largest weight at most): for drafters, whose outputs are only proposals."""
    rows, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {k}")
    blocks = weight.detach().float().reshape(rows, k // 32, 32)  # [N, B, 32]
    scale = (blocks.abs().amax(dim=-1) / 127).half()  # [N, B]
    inverse = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    quants = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)  # [N, B, 32]
    packed = torch.cat([scale.view(torch.uint8).reshape(rows, k // 32, 2), quants.view(torch.uint8)], dim=-1)
    return QuantizedLinear("Q8_0", packed.reshape(rows, -1), k)


_PROMPT_CHUNK = contextvars.ContextVar("flashtree_prompt_chunk", default=False)


@contextlib.contextmanager
def prompt_chunk(active: bool) -> Iterator[None]:
    """Inside, a :class:`Float32Rows` product of the per-op path is F.linear's: a prompt chunk runs alike in every
    decoding mode, and MKL's blocked products are faster at hundreds of rows (a 512-token SmolLM2 prompt took
    1.6x as long with the kernel: benchmarks/cpu_dense_float32_rows.py). Bits then depend on the chunk's shape,
    as before; decode and verification forwards, which must agree row by row, never run inside."""
    token = _PROMPT_CHUNK.set(active)
    try:
        yield
    finally:
        _PROMPT_CHUNK.reset(token)


def in_prompt_chunk() -> bool:
    """Whether a :func:`prompt_chunk` is active (its products then go to F.linear)."""
    return _PROMPT_CHUNK.get()


class Float32Rows(QuantizedLinear):
    """The block kernel over a float32 CPU weight ``[N, K]`` as it is (type ``F32``: reads the weight's own
    memory, no copy; keep the weight unchanged while the holder lives). Outside :func:`prompt_chunk`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__("F32", weight.view(torch.uint8), weight.shape[1])
        self.weight = weight  # [N, K]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if in_prompt_chunk():
            return torch.nn.functional.linear(x, self.weight, bias)
        return super().__call__(x, bias)


def float32_rows_fit(weight: torch.Tensor | None) -> bool:
    """Whether the kernel can hold ``weight``'s rows: a contiguous float32 CPU matrix, K a multiple of 32 (a
    GGUF-held product's weight is empty: no)."""
    return weight is not None and weight.dim() == 2 and weight.dtype == torch.float32 \
        and weight.device.type == "cpu" and weight.shape[1] % 32 == 0 and weight.is_contiguous()


def float32_rows(weight: torch.Tensor | None) -> Float32Rows | None:
    """A :class:`Float32Rows` over ``weight``; None where :func:`float32_rows_fit` says the kernel cannot."""
    return Float32Rows(weight.detach()) if float32_rows_fit(weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           quant: QuantizedLinear | None = None) -> torch.Tensor:
    """``F.linear``, from the blocks when ``quant`` is set (then ``weight`` is not read: it may be empty)."""
    if quant is not None:
        return quant(x, bias)
    return torch.nn.functional.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor, quant: QuantizedLinear | None = None) -> torch.Tensor:
    """``F.embedding`` of ``ids [...]`` -> ``[..., K]``; with ``quant``, the rows rebuilt from the blocks
    (bit-identical to the fp32 weight's rows; ``weight`` is then not read: it may be empty)."""
    if quant is None:
        return torch.nn.functional.embedding(ids, weight)
    return quant.dequantize(ids.reshape(-1)).view(*ids.shape, quant.in_features)  # [..., K]
