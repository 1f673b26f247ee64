"""FP8 checkpoints: FP8 products on CUDA (Hopper and Ada), dequantized at load elsewhere.

Two layouts: block-wise (``quantization_config.quant_method == "fp8"`` with ``weight_block_size``
[128, 128], as Qwen3-*-FP8 and DeepSeek-V3 ship): an e4m3 ``X.weight [N, K]`` and a float32
``X.weight_scale_inv [ceil(N / 128), ceil(K / 128)]``, one factor per 128 x 128 block; and
compressed-tensors' float-quantized layout: ``X.weight_scale`` per output channel ``[N, 1]`` or
per tensor. Either way the weight is ``float(fp8 value) * its factor``. Unquantized tensors
(embeddings, norms, the LM head, routers) load as they are.

Where the Triton FP8 product runs (:func:`runs_fp8_products`: a CUDA device of compute capability 8.9 or
more, or Triton's interpreter in tests), :func:`read_fp8` keeps each dense linear group (fused q/k/v, o,
fused gate/up, down) as an :class:`~flashtree.kernels.gpu.fp8_gemm.Fp8Linear` on the device: its bf16
weights are never made, and every product reads the FP8 bytes. Elsewhere (the CPU), and for the experts
of MoE layers, :func:`dequantized` gives the weight in the model's dtype at load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flashtree.errors import CheckpointError
from flashtree.kernels import gpu as gpu_kernels
from flashtree.kernels.gpu.fp8_gemm import FP8_DTYPES, SCALE_BLOCK, Fp8Linear
from flashtree.models.quantized_weights import BlockGroup, block_groups

if TYPE_CHECKING:
    from flashtree.models.loader import Checkpoint

log = logging.getLogger("flashtree")

BLOCK = SCALE_BLOCK  # the one weight_block_size side this loader reads (128)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")  # tensors that are not parameters
FP8_GROUPS = ("qkv_quant", "o_quant", "gate_up_quant", "down_quant")  # the groups kept FP8 (block_groups' attrs)
MIN_CAPABILITY = (8, 9)  # Triton converts e4m3 on Ada / Hopper and later


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


def part_scales(name: str, weights: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The scales of the FP8 tensor ``weights[name] [N, K]`` as :class:`Fp8Linear` takes them: (block scales
    ``[ceil(N / 128), ceil(K / 128)]``, 128), or (one factor per row ``[N, 1]``, 1) for a channel or tensor
    scale. Raises CheckpointError naming the tensor when its scale is missing or does not fit."""
    rows, cols = weights[name].shape
    block_scale, scale = weights.get(name + "_scale_inv"), weights.get(name + "_scale")
    if block_scale is not None:
        blocks = (-(-rows // BLOCK), -(-cols // BLOCK))
        if tuple(block_scale.shape) != blocks:
            raise CheckpointError(f"{name}_scale_inv has shape {list(block_scale.shape)}; a [{rows}, {cols}] weight "
                                  f"in {BLOCK} x {BLOCK} blocks needs {list(blocks)}")
        return block_scale.float(), BLOCK
    if scale is not None:
        if scale.numel() == 1:
            return scale.float().reshape(1, 1).expand(rows, 1), 1
        if scale.numel() == rows and (scale.dim() == 1 or tuple(scale.shape) == (rows, 1)):
            return scale.float().reshape(rows, 1), 1
        raise CheckpointError(f"{name}_scale has shape {list(scale.shape)}; allowed for a [{rows}, {cols}] weight: "
                              f"[{rows}, 1] or [{rows}] (per channel) or one value (per tensor)")
    raise CheckpointError(f"{name} is stored in {weights[name].dtype} without {name}_scale_inv (block scales) "
                          f"or {name}_scale (channel or tensor scale)")


def quantize_fp8(weight: torch.Tensor, blocks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[N, K]`` in a checkpoint's FP8 layout: (e4m3 values ``[N, K]``, float32 scales) with scales
    per 128 x 128 block (``weight_scale_inv [ceil(N / 128), ceil(K / 128)]``, ``blocks``) or per row
    (``weight_scale [N, 1]``), each block's largest magnitude mapped to e4m3's largest (448). For tests and
    benchmarks (random FP8 checkpoints); on the weight's device."""
    rows, cols = weight.shape
    weight = weight.float()
    if blocks:
        padded = weight.new_zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
        padded[:rows, :cols] = weight
        largest = padded.view(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK).abs().amax(dim=(1, 3))  # [RB, KB]
    else:
        largest = weight.abs().amax(dim=1, keepdim=True)  # [N, 1]
    scale = torch.where(largest > 0, largest / 448.0, torch.ones_like(largest))  # (an all-zero block: any factor)
    factor = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols] if blocks else scale
    return (weight / factor).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantized(name: str, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``weights[name]`` in ``dtype``: an FP8 tensor times its scale (see the module docstring)."""
    tensor = weights[name]
    if tensor.dtype not in FP8_DTYPES:
        return tensor.to(dtype)
    return Fp8Linear(tensor, *part_scales(name, weights), name=name).dequantize(dtype)


def fused_fp8(names: Sequence[str], weights: Mapping[str, torch.Tensor], device: torch.device) -> Fp8Linear:
    """The FP8 tensors ``names`` (each ``[N_i, K]``) stacked along N into one :class:`Fp8Linear` on ``device``.
    Block scales stay blocks where every part but the last fills whole 128-row blocks; otherwise each row
    gets its own copy of its factors (scale_rows 1)."""
    parts = [weights[name] for name in names]
    if len({part.dtype for part in parts}) != 1 or len({part.shape[1] for part in parts}) != 1:
        raise CheckpointError(f"{', '.join(names)} are fused into one product and need one FP8 dtype and one width; "
                              f"got {[f'{p.dtype} {list(p.shape)}' for p in parts]}")
    scales = [part_scales(name, weights) for name in names]
    if all(rows == BLOCK for _, rows in scales) and all(part.shape[0] % BLOCK == 0 for part in parts[:-1]):
        scale, scale_rows = torch.cat([s for s, _ in scales]), BLOCK
    else:
        columns = max(s.shape[1] for s, _ in scales)
        per_row = [s.repeat_interleave(rows, 0)[:part.shape[0]].expand(-1, columns)  # [N_i, columns]
                   for part, (s, rows) in zip(parts, scales)]
        scale, scale_rows = torch.cat(per_row), 1  # [N, columns]
    return Fp8Linear(torch.cat(parts).to(device), scale.to(device), scale_rows, name=" + ".join(names))


def runs_fp8_products(device: torch.device) -> bool:
    """The Triton FP8 product runs on ``device`` (module docstring)."""
    device = torch.device(device)
    if not gpu_kernels.available():
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY
    return gpu_kernels.interpreting()


def read_fp8(checkpoint: Checkpoint, device: torch.device) -> dict[BlockGroup, Fp8Linear]:
    """The linear groups a model of ``checkpoint`` keeps in FP8 on ``device`` (module docstring): those whose
    every weight is FP8, where :func:`runs_fp8_products`; none otherwise (their weights are dequantized at
    load; one log line on a CUDA device that cannot run the product)."""
    weights = checkpoint.weights
    if weights is None or not any(t.dtype in FP8_DTYPES for t in weights.values()):
        return {}
    if not runs_fp8_products(device):
        if torch.device(device).type == "cuda":
            log.warning("flashtree: FP8 weights dequantized at load: the FP8 product needs Triton and a GPU of "
                        "compute capability >= %d.%d", *MIN_CAPABILITY)
        return {}
    shapes = _parameter_shapes(checkpoint.config)
    found = {}
    for group in block_groups(checkpoint.config):
        if group.attr not in FP8_GROUPS or not all(name in weights for name in group.weights):
            continue
        if not all(weights[name].dtype in FP8_DTYPES for name in group.weights):
            continue  # (an unquantized or partly quantized group loads as the model's dtype)
        for name in group.weights:
            if tuple(weights[name].shape) != shapes[name]:
                raise CheckpointError(f"tensor {name} has shape {list(weights[name].shape)}, the config implies "
                                      f"{list(shapes[name])}")
        found[group] = fused_fp8(group.weights, weights, device)
    return found


def _parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    from flashtree.models.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}
