"""FP8 checkpoints, dequantized as they load (the CPU path; FP8 GEMMs on Hopper are future work).

Two layouts: block-wise (``quantization_config.quant_method == "fp8"`` with ``weight_block_size``
[128, 128], as Qwen3-*-FP8 and DeepSeek-V3 ship): an e4m3 ``X.weight [N, K]`` and a float32
``X.weight_scale_inv [ceil(N / 128), ceil(K / 128)]``, one factor per 128 x 128 block; and
compressed-tensors' float-quantized layout: ``X.weight_scale`` per output channel ``[N, 1]`` or
per tensor. Either way the weight is ``float(fp8 value) * its factor``. Unquantized tensors
(embeddings, norms, the LM head, routers) load as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flashtree.errors import CheckpointError

BLOCK = 128
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")  # tensors that are not parameters


def check_quantization(quantization: Mapping[str, Any] | None, source: str) -> None:
    """Refuse a ``quantization_config`` this loader cannot read, naming it and what is allowed."""
    if quantization is None:
        return
    method = quantization.get("quant_method")
    if method == "fp8":
        block = quantization.get("weight_block_size")
        if block is not None and list(block) != [BLOCK, BLOCK]:
            raise CheckpointError(f"{source}: quantization_config.weight_block_size {block} is not supported; "
                                  f"allowed: [{BLOCK}, {BLOCK}]")
        return
    if method == "compressed-tensors":
        if quantization.get("format") not in (None, "float-quantized"):
            raise CheckpointError(f"{source}: compressed-tensors format {quantization.get('format')!r} is not "
                                  f"supported; allowed: float-quantized (FP8)")
        return
    raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported; "
                          f"allowed: fp8 (block-wise), compressed-tensors (FP8 float-quantized)")


def dequantized(name: str, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``weights[name]`` in ``dtype``: an FP8 tensor times its scale (see the module docstring)."""
    tensor = weights[name]
    if tensor.dtype not in FP8_DTYPES:
        return tensor.to(dtype)
    value = tensor.float()  # [N, K]
    block_scale, scale = weights.get(name + "_scale_inv"), weights.get(name + "_scale")
    if block_scale is not None:
        rows, cols = value.shape
        if tuple(block_scale.shape) != (-(-rows // BLOCK), -(-cols // BLOCK)):
            raise CheckpointError(f"{name}_scale_inv has shape {list(block_scale.shape)}; a [{rows}, {cols}] weight "
                                  f"in {BLOCK} x {BLOCK} blocks needs [{-(-rows // BLOCK)}, {-(-cols // BLOCK)}]")
        factor = block_scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    elif scale is not None:
        factor = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    else:
        raise CheckpointError(f"{name} is stored in {tensor.dtype} without {name}_scale_inv (block scales) "
                              f"or {name}_scale (channel or tensor scale)")
    return (value * factor).to(dtype)
