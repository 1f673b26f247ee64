"""Turn a checkpoint into a ready :class:`CausalLM` on a device, in a dtype (:func:`load_target`)."""

from __future__ import annotations

from typing import AbstractSet, Mapping, NamedTuple

import torch

from flashtree.config import EngineConfig
from flashtree.errors import CheckpointError, ConfigError
from flashtree.kernels.cpu.quant_linear import QuantizedLinear
from flashtree.models.config import ModelConfig
from flashtree.models.fp8 import dequantized, read_fp8
from flashtree.models.loader import load_checkpoint
from flashtree.models.moe import per_expert_weights
from flashtree.models.quantized_weights import (
    BlockGroup,
    attach_quantized,
    held_weights,
    read_quantized,
    release_weights,
)
from flashtree.models.transformer import CausalLM


class LoadedTarget(NamedTuple):
    """A built target model and its tokenizer; engines given the same one share its weights."""

    model: CausalLM
    tokenizer: object  # transformers tokenizer or None


def load_target(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedTarget:
    """The target of ``config.target`` on ``device`` in ``dtype``, with the kernels ``config.kernels`` allows."""
    target, kernels = config.target, config.kernels
    checkpoint = load_checkpoint(target.model, random_weights=target.random_weights)
    quantized = read_quantized(checkpoint, device, dtype, enabled=kernels.quant_kernels)  # CPU fp32 GGUF models
    for holder in quantized.values():
        holder.int8_activations = kernels.int8_activations
    quantized = quantized or read_fp8(checkpoint, device)  # FP8 checkpoints on CUDA: FP8 products
    model = build_model(checkpoint.config, checkpoint.weights, device, dtype, seed=target.seed, quantized=quantized)
    model.use_fused_kernels(kernels.gpu_kernels, kernels.cpu_kernels, attention=kernels.triton_attention,
                            exact=kernels.exact)
    model.hold_float32_products(kernels.quant_kernels)  # (CPU float32 only)
    model.use_layer_stack(kernels.cpu_layer_stack)
    return LoadedTarget(model, checkpoint.tokenizer)


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` picks CUDA when present. ``cuda`` without a GPU is an error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r} asked for CUDA, but no CUDA GPU is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Default bf16 on CUDA, fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor] | None,
                device: torch.device, dtype: torch.dtype, seed: int = 0,
                quantized: Mapping[BlockGroup, QuantizedLinear] | None = None) -> CausalLM:
    """Weights in Hugging Face names; ``None`` means random weights (init on the device).
    ``quantized``: groups held as GGUF blocks (``quantized_weights.read_quantized``) or FP8 weights
    (``fp8.read_fp8``): their dense weights are never allocated nor read, and the holders are attached."""
    quantized = quantized or {}
    held = held_weights(quantized)
    with torch.device("meta"):
        model = CausalLM(config)
    release_weights(model, held)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if weights is None:
        init_random_weights(model, seed)
    else:
        _load_weights(model, weights, skip=held)
    model.eval().requires_grad_(False)
    model.fuse()
    attach_quantized(model, quantized)
    return model


def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights for speed runs: N(0, 0.02) matrices, unit norms, zero biases."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def _load_weights(model: CausalLM, weights: dict[str, torch.Tensor], skip: AbstractSet[str] = frozenset()) -> None:
    weights = per_expert_weights(weights)
    expected = {name: param for name, param in model.named_parameters() if name not in skip}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    copy_weights(expected, weights, "the config")


def copy_weights(params: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``weights[name]`` into every parameter (FP8 ones dequantized: ``models/fp8.py``), refusing a
    shape the ``source`` does not imply."""
    for name, param in params.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name} has shape {list(tensor.shape)}, {source} implies {list(param.shape)}")
        param.data.copy_(dequantized(name, weights, param.dtype))
