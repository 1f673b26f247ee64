"""CPU products with few rows straight from a GGUF's quantized blocks (Q4_0, Q4_1, Q8_0).

A GGUF model is dequantized once to float32 (``models/gguf_convert.py``); a CPU decode step then
streams every fp32 weight per token and is bound by memory bandwidth. Products of at most
:data:`MAX_ROWS` rows (decode steps, verification trees, drafter blocks, batches of a few dozen
requests) read the GGUF blocks instead, 0.56-1.06 bytes per weight instead of 4. The kernel
(``kernels.cpp``) rebuilds each weight in registers exactly as the converter stored it and
accumulates in float32:

- Q4_1: ``fma(d, q, m)``. ``d`` is an fp16 value and ``q`` a 4-bit integer, so ``d * q`` is
  exact in fp32 and the fma rounds once, like numpy's ``d * q + m``.
- Q4_0: ``fma(d, q, -8 d)`` = ``d * (q - 8)`` exactly (every term and the result are
  representable), as numpy's ``d * (q - 8)``.
- Q8_0: ``d * q``, exact.

so the weights are bit-identical to the fp32 ones (checked at load on a spread of rows of every
weight); only the summation order differs from MKL's. Each weight block is decoded once for up to
8 rows of a product, and a row's result does not depend on how many rows share the call. The
kernel prefetches 4 KB ahead in the weight stream: the per-layer products are too short for the
hardware prefetcher alone. Larger products (prefill, big trees) use the fp32 weights, kept too.
:func:`quantize_q8_0` rounds a drafter's weights to Q8_0 blocks. ``--no-quant-kernels`` (``KernelConfig``)
turns the block products off.
"""


from __future__ import annotations

from typing import Sequence

import torch

from flashtree.kernels.cpu.library import load_kernels

# products with at most this many rows use the block kernel; more rows keep the fp32 weights (at 32 rows
# the two cost the same on a 2-core Xeon; the kernel's arithmetic per row is the same for every count)
MAX_ROWS = 32

# type name -> (bytes per 32-weight block, kernel type code)
BLOCK_TYPES = {"Q4_0": (18, 0), "Q4_1": (20, 1), "Q8_0": (34, 2)}


class QuantizedLinear:
    """One linear weight ``[N, K]`` kept as GGUF blocks (rows of ``K / 32`` blocks, raw bytes).

    Call it with a float32 CPU ``x [..., K]`` of at most :data:`MAX_ROWS` rows (and a contiguous
    float32 ``bias [N]`` or None); :func:`linear` picks it or the fp32 weight by the row count."""

    def __init__(self, type_name: str, blocks: torch.Tensor, in_features: int):
        if type_name not in BLOCK_TYPES:
            raise ValueError(f"unsupported block type {type_name!r}; allowed: {', '.join(BLOCK_TYPES)}")
        block_bytes, self.type_code = BLOCK_TYPES[type_name]
        if in_features % 32 or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // 32 * block_bytes:
            raise ValueError(f"{type_name} blocks of shape {list(blocks.shape)} do not hold rows of {in_features}")
        self.type_name = type_name
        self.blocks = blocks.contiguous()
        self.out_features, self.in_features = blocks.shape[0], in_features
        self._lib = load_kernels()
        self._gemm = self._lib.flashtree_block_gemm
        self._blocks_ptr = self.blocks.data_ptr()

    @classmethod
    def concat(cls, parts: Sequence["QuantizedLinear"]) -> "QuantizedLinear":
        """The fused weight (rows of every part, in order); all parts share one type and K."""
        first = parts[0]
        if any(p.type_name != first.type_name or p.in_features != first.in_features for p in parts):
            raise ValueError("fused weights need one block type and one input size")
        return cls(first.type_name, torch.cat([p.blocks for p in parts]), first.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        rows = x.numel() // self.in_features
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        status = self._gemm(self.type_code, x.data_ptr(), self._blocks_ptr,
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           quant: QuantizedLinear | None = None) -> torch.Tensor:
    """``F.linear`` that takes products with few rows from the blocks when ``quant`` is set."""
    if quant is not None and x.numel() <= MAX_ROWS * quant.in_features:
        return quant(x, bias)
    return torch.nn.functional.linear(x, weight, bias)
