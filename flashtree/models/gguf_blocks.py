"""A GGUF model's quantized matrices kept as blocks for the CPU block kernel (:mod:`flashtree.kernels.cpu.quant_linear`).

The GGUF conversion writes ``gguf_blocks.safetensors`` beside the fp32 weights (the first load of an
older cache entry adds it); :func:`maybe_attach_quantized` gives a CPU fp32 model's linears their
blocks, each checked bit-identical to the fp32 weight it stands for.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from flashtree.kernels.cpu.library import KernelUnavailable, load_kernels
from flashtree.kernels.cpu.quant_linear import BLOCK_TYPES, QuantizedLinear
from flashtree.models.gguf_layout import unpermute_for_hf

if TYPE_CHECKING:
    from flashtree.models.loader import Checkpoint
    from flashtree.models.transformer import CausalLM

log = logging.getLogger("flashtree")

CHECKED_ROWS = 64  # rows per weight compared with the fp32 weight at load
BLOCKS_FILE = "gguf_blocks.safetensors"  # beside model.safetensors in the conversion cache


def gguf_blocks(reader, architecture: str, heads: int, kv_heads: int) -> dict[str, tuple[str, np.ndarray]]:
    """Every Q4_0 / Q4_1 / Q8_0 matrix of an open GGUF file: GGUF name -> (type name, raw blocks
    ``uint8 [rows, K / 32 * block bytes]``), the q/k rows un-permuted like the converter does
    (whole blocks move with their rows)."""
    found = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        rows = int(tensor.shape[1])  # GGUF lists the fastest dimension first
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
        raw = unpermute_for_hf(tensor.name, raw, architecture, heads, kv_heads)
        found[tensor.name] = (type_name, np.array(raw, order="C"))  # a copy: the reader's memmap is read-only
    return found


def save_blocks(blocks: dict[str, tuple[str, np.ndarray]], out_dir: Path, source: dict) -> None:
    """Write ``blocks`` to ``out_dir/gguf_blocks.safetensors`` (atomically), tagged with the source
    record so a file converted from another GGUF is never used."""
    import safetensors.numpy

    metadata = {"types": json.dumps({name: t for name, (t, _) in blocks.items()}),
                "source": json.dumps(_source_key(source))}
    tmp = out_dir / f".{BLOCKS_FILE}.{os.getpid()}.tmp"
    safetensors.numpy.save_file({name: raw for name, (_, raw) in blocks.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, out_dir / BLOCKS_FILE)


def _source_key(source: dict) -> list:
    return [source.get("path"), source.get("size"), source.get("mtime_ns")]


def load_blocks(model_dir: Path, source: dict, architecture: str, heads: int, kv_heads: int) -> dict[str, QuantizedLinear]:
    """The holders of a converted GGUF: from ``gguf_blocks.safetensors`` in its cache directory,
    written from the GGUF itself (and kept for next time) when missing or stale."""
    import safetensors

    path = model_dir / BLOCKS_FILE
    found = None
    if path.is_file():
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                if json.loads(metadata.get("source", "null")) == _source_key(source):
                    types = json.loads(metadata["types"])
                    found = {name: (types[name], f.get_tensor(name)) for name in f.keys()}
        except (OSError, ValueError, KeyError, safetensors.SafetensorError):
            found = None
    if found is None:
        import gguf

        gguf_path = Path(source["path"])
        if not gguf_path.is_file() or gguf_path.stat().st_size != source.get("size") \
                or gguf_path.stat().st_mtime_ns != source.get("mtime_ns"):
            raise KernelUnavailable(f"{gguf_path} changed or is gone since it was converted")
        raw = gguf_blocks(gguf.GGUFReader(str(gguf_path)), architecture, heads, kv_heads)
        try:
            save_blocks(raw, model_dir, source)
        except OSError as err:  # a read-only cache: fine, read the GGUF again next time
            log.info("flashtree: cannot cache the GGUF blocks in %s: %s", model_dir, err)
        found = {name: (t, torch.from_numpy(array)) for name, (t, array) in raw.items()}
    holders = {}
    for name, (type_name, blocks) in found.items():
        block_bytes = BLOCK_TYPES[type_name][0]
        holders[name] = QuantizedLinear(type_name, blocks, blocks.shape[1] // block_bytes * 32)
    return holders


def _fused(blocks: dict[str, QuantizedLinear], names: Sequence[str]) -> QuantizedLinear | None:
    if not all(name in blocks for name in names):
        return None
    parts = [blocks[name] for name in names]
    if len({(p.type_name, p.in_features) for p in parts}) != 1:
        return None
    return parts[0] if len(parts) == 1 else QuantizedLinear.concat(parts)


def attach_quantized(model: "CausalLM", blocks: dict[str, QuantizedLinear]) -> int:
    """Give ``model``'s linears their GGUF blocks (by GGUF name; fused like the model: qkv,
    gate_up; the lm_head from ``output`` or, tied, ``token_embd``). Every holder is checked
    bit-identical to the fp32 weight it stands for (on a spread of rows: a wrong type, layout or row
    order shows in every row; the tests compare whole weights). Returns the number of weights attached;
    raises KernelUnavailable."""
    cfg = model.config
    plan = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"blk.{i}."
        plan += [
            (attn, "qkv_quant", attn.qkv_weight, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            (attn, "o_quant", attn.o_proj.weight, [p + "attn_output.weight"]),
            (mlp, "gate_up_quant", mlp.gate_up, [p + "ffn_gate.weight", p + "ffn_up.weight"]),
            (mlp, "down_quant", mlp.down_proj.weight, [p + "ffn_down.weight"]),
        ]
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    plan.append((model, "lm_head_quant", model.lm_head.weight, [head]))
    attached = 0
    for owner, attr, weight, names in plan:
        quant = _fused(blocks, names) if weight is not None else None
        if quant is None:
            continue
        rows = torch.arange(0, quant.out_features, max(1, quant.out_features // CHECKED_ROWS))
        if tuple(weight.shape) != (quant.out_features, quant.in_features) or weight.dtype != torch.float32 \
                or not torch.equal(quant.dequantize(rows), weight[rows]):
            raise KernelUnavailable(f"the GGUF blocks of {', '.join(names)} differ from the loaded fp32 weights")
        setattr(owner, attr, quant)
        attached += 1
    return attached


def detach_quantized(model: "CausalLM") -> None:
    """Back to the fp32 path everywhere."""
    model.layer_stack = None  # (it reads the blocks)
    holders = [model] + [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    for owner in holders:
        for attr in ("qkv_quant", "o_quant", "gate_up_quant", "down_quant", "lm_head_quant"):
            if getattr(owner, attr, None) is not None:
                setattr(owner, attr, None)


def maybe_attach_quantized(model: "CausalLM", checkpoint: "Checkpoint", enabled: bool = True) -> bool:
    """Use the block kernel for ``model`` when it was loaded from a GGUF with quantized matrices,
    lives on the CPU in float32, and the kernel works here; one log line when it cannot."""
    raw_config = checkpoint.raw_config
    source = raw_config.get("flashtree_source_gguf") if isinstance(raw_config, dict) else None
    if not enabled or checkpoint.weights is None or not isinstance(source, dict) or not source.get("path"):
        return False
    if not set(source.get("tensor_types") or BLOCK_TYPES) & set(BLOCK_TYPES):
        return False  # an F32/F16 GGUF: nothing quantized to keep
    param = model.lm_head.weight
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    cfg = model.config
    try:
        load_kernels()
        blocks = load_blocks(checkpoint.path, source, str(raw_config.get("model_type", "")),
                             cfg.num_attention_heads, cfg.num_key_value_heads)
        attached = attach_quantized(model, blocks)
    except (KernelUnavailable, OSError, ValueError) as err:
        detach_quantized(model)
        log.warning("flashtree: quantized CPU kernels off, using the float32 weights: %s", err)
        return False
    return attached > 0
