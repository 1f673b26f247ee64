"""A CPU float32 model whose GGUF matrices are held as blocks instead of fp32 weights.

Each product of the model (fused as the model fuses them: q/k/v, gate/up), the embedding and the
lm_head is a :class:`BlockGroup`. Where a GGUF checkpoint holds every matrix of a group as blocks the
kernel reads (``BLOCK_TYPES``; parts of different types make a mixed product), :func:`read_quantized`
reads them from the conversion cache (``gguf_blocks.py``) and checks them bit-identical to the converted
fp32 weights on a spread of rows.
``build.py`` then never loads those fp32 weights (the parameters stay empty tensors: the model's
``state_dict`` and parameter list keep their names) and :func:`attach_quantized` hands the blocks to
the linears, whose every product and (embedding) lookup reads them (``kernels/cpu/quant_linear.py``).
:func:`detach_quantized` rebuilds the fp32 weights from the blocks (bit-identical) and returns the
model to fp32 products.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, NamedTuple

import torch
from torch import nn

from flashtree.kernels.cpu.huge_pages import BlockArena
from flashtree.kernels.cpu.library import KernelUnavailable, load_kernels
from flashtree.kernels.cpu.quant_linear import (
    BLOCK_TYPES,
    MixedQuantizedLinear,
    QuantizedLinear,
)
from flashtree.models.config import ModelConfig
from flashtree.models.gguf_blocks import StoredMatrix, load_blocks
from flashtree.models.gguf_experts import ExpertMatrix, WeightsWithExperts
from flashtree.models.safetensors_reads import SafetensorsFile

if TYPE_CHECKING:
    from flashtree.models.loader import Checkpoint

log = logging.getLogger("flashtree")

RowReader = Callable[[str, torch.Tensor], torch.Tensor]  # (weight name, row ids [R]) -> its rows [R, K]

CHECKED_ROWS = 16  # rows per matrix compared with the fp32 weight at load (a spread over all rows)


class BlockGroup(NamedTuple):
    """The weights one block matrix stands for."""

    owner: str  # the module that holds the blocks ("" for the model itself)
    attr: str  # its attribute for them: qkv_quant, o_quant, gate_up_quant, down_quant, embed_quant, lm_head_quant
    fused: str | None  # the owner's fused fp32 weight (qkv_weight, gate_up), or None
    weights: tuple[str, ...]  # the fp32 parameters (Hugging Face names), in fused order
    gguf: tuple[str, ...]  # their GGUF matrices, in the same order


def _weights(prefix: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{name}.weight" for name in names)


def block_groups(config: ModelConfig) -> list[BlockGroup]:
    """Every group a model of ``config`` can hold as blocks (a sparse MoE layer's experts one by one; the
    lm_head of tied embeddings is the embedding's ``token_embd``)."""
    groups = []
    for i in range(config.num_hidden_layers):
        attn, mlp, blk = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"blk.{i}"
        groups += [BlockGroup(attn, "qkv_quant", "qkv_weight", _weights(attn, "q_proj", "k_proj", "v_proj"),
                              _weights(blk, "attn_q", "attn_k", "attn_v")),
                   BlockGroup(attn, "o_quant", None, _weights(attn, "o_proj"), _weights(blk, "attn_output"))]
        if config.moe is None or not config.moe.sparse(i):
            groups += [BlockGroup(mlp, "gate_up_quant", "gate_up", _weights(mlp, "gate_proj", "up_proj"),
                                  _weights(blk, "ffn_gate", "ffn_up")),
                       BlockGroup(mlp, "down_quant", None, _weights(mlp, "down_proj"), _weights(blk, "ffn_down"))]
        else:  # each expert: its matrices are read from the GGUF by their Hugging Face names (gguf_experts.py)
            for e in range(config.moe.num_experts):
                expert = f"{mlp}.experts.{e}"
                gate_up, down = _weights(expert, "gate_proj", "up_proj"), _weights(expert, "down_proj")
                groups += [BlockGroup(expert, "gate_up_quant", "gate_up", gate_up, gate_up),
                           BlockGroup(expert, "down_quant", None, down, down)]
    embedding = (("model.embed_tokens.weight",), ("token_embd.weight",))
    groups.append(BlockGroup("", "embed_quant", None, *embedding))
    head = embedding if config.tie_word_embeddings else (("lm_head.weight",), ("output.weight",))
    groups.append(BlockGroup("", "lm_head_quant", None, *head))
    return groups


def read_quantized(checkpoint: "Checkpoint", device: torch.device, dtype: torch.dtype,
                   enabled: bool = True) -> dict[BlockGroup, QuantizedLinear]:
    """The groups a model of ``checkpoint`` holds as blocks: where it was converted from a GGUF with
    quantized matrices, runs on the CPU in float32, and the kernel works here; else none (one log
    line when the kernel or the blocks fail)."""
    raw_config = checkpoint.raw_config
    source = raw_config.get("flashtree_source_gguf") if isinstance(raw_config, dict) else None
    if not enabled or checkpoint.weights is None or not isinstance(source, dict) or not source.get("path"):
        return {}
    if not set(source.get("tensor_types") or BLOCK_TYPES) & set(BLOCK_TYPES):
        return {}  # an F32/F16 GGUF: nothing quantized to keep
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return {}
    cfg = checkpoint.config
    try:
        load_kernels()
        stored = load_blocks(checkpoint.path, source, str(raw_config.get("model_type", "")),
                             cfg.num_attention_heads, cfg.num_key_value_heads)
        experts = checkpoint.weights.experts if isinstance(checkpoint.weights, WeightsWithExperts) else {}
        stored = {**stored, **{name: StoredMatrix(m.type_name, m.rows, m.row_bytes, m.read_into)
                               for name, m in experts.items() if m.type_name in BLOCK_TYPES}}
        return read_groups(block_groups(cfg), stored, checkpoint.weights, row_reader(checkpoint.path, experts))
    except (KernelUnavailable, OSError, ValueError) as err:
        log.warning("flashtree: quantized CPU kernels off, using the float32 weights: %s", err)
        return {}


def row_reader(directory: Path, experts: Mapping[str, ExpertMatrix]) -> RowReader | None:
    """Rows of the float32 weights as the converter decodes them: from the conversion's files
    (:func:`fp32_rows`), an expert's from the GGUF (decoded by gguf-py, not by the block kernel)."""
    fp32 = fp32_rows(directory)
    if not experts:
        return fp32

    def rows(name: str, picked: torch.Tensor) -> torch.Tensor:
        return experts[name].dequantized_rows(picked) if name in experts else fp32(name, picked)

    return rows


def fp32_rows(directory: Path) -> RowReader | None:
    """Reads of rows of the float32 weights of a GGUF conversion (``model.safetensors``, or the shards
    its index lists) that leave no memory map behind; None where there are none."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return SafetensorsFile(single).rows
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    files: dict[str, SafetensorsFile] = {}

    def rows(name: str, picked: torch.Tensor) -> torch.Tensor:
        shard = weight_map[name]
        if shard not in files:
            files[shard] = SafetensorsFile(directory / shard)
        return files[shard].rows(name, picked)

    return rows


def read_groups(groups: Iterable[BlockGroup], stored: Mapping[str, StoredMatrix],
                weights: Mapping[str, torch.Tensor], rows: RowReader | None = None) -> dict[BlockGroup, QuantizedLinear]:
    """The groups whose matrices are all in ``stored`` with one width (of one type, or of several: a
    :class:`MixedQuantizedLinear`), each read once (groups of
    the same matrices share one holder) and checked against the fp32 ``weights`` (their rows read by
    ``rows``, default: indexing ``weights``; reads from a file that keep a memory map untouched); raises
    KernelUnavailable when blocks differ from their weight."""
    rows = rows or (lambda name, picked: weights[name][picked])
    groups = list(groups)
    readable = {group.gguf: sum(p.rows * p.row_bytes for p in _parts(group, stored)) for group in groups
                if _readable(group, stored, weights)}
    arena = BlockArena(list(readable.values()))  # every holder's blocks in one (huge-page) mapping
    holders: dict[tuple[str, ...], QuantizedLinear | None] = {}
    found = {}
    for group in groups:
        if group.gguf not in holders:
            holders[group.gguf] = _read_group(group, stored, weights, rows, arena) if group.gguf in readable else None
        if holders[group.gguf] is not None:
            found[group] = holders[group.gguf]
    return found


def _parts(group: BlockGroup, stored: Mapping[str, StoredMatrix]) -> list[StoredMatrix | None]:
    return [stored.get(name) for name in group.gguf]


def _readable(group: BlockGroup, stored: Mapping[str, StoredMatrix], weights: Mapping[str, torch.Tensor]) -> bool:
    """Every matrix of ``group`` is stored as blocks, all of one width, and its fp32 weights are there."""
    parts = _parts(group, stored)
    return (None not in parts and len({p.in_features for p in parts}) == 1
            and all(name in weights for name in group.weights))


def _read_group(group: BlockGroup, stored: Mapping[str, StoredMatrix], weights: Mapping[str, torch.Tensor],
                rows: RowReader, arena: BlockArena) -> QuantizedLinear:
    parts = _parts(group, stored)
    if len({p.type_name for p in parts}) == 1:
        blocks = arena.take(sum(p.rows for p in parts), parts[0].row_bytes)
        quant = QuantizedLinear(parts[0].type_name, _read_parts(parts, blocks), parts[0].in_features)
    else:  # e.g. Q4_K_M's q/k Q4_K and v Q6_K: one product of per-type parts
        singles = [QuantizedLinear(p.type_name, _read_parts([p], torch.empty(p.rows, p.row_bytes, dtype=torch.uint8)),
                                   p.in_features) for p in parts]
        total = sum(p.rows * p.row_bytes for p in parts)
        quant = MixedQuantizedLinear(singles, flat=arena.take(1, total).view(-1))
    _check(quant, group, weights, rows)
    return quant


def _read_parts(parts: list[StoredMatrix], blocks: torch.Tensor) -> torch.Tensor:
    """The parts' blocks stacked into ``blocks`` (``uint8 [rows, row bytes]``, parts of one type)."""
    offset = 0
    for part in parts:
        part.read_into(blocks[offset:offset + part.rows])
        offset += part.rows
    return blocks


def _check(quant: QuantizedLinear, group: BlockGroup, weights: Mapping[str, torch.Tensor], rows: RowReader) -> None:
    """Blocks rebuild the fp32 weights exactly on a spread of each part's rows (a wrong type, layout or
    row order shows in every row; the tests compare whole weights)."""
    offset = 0
    for name in group.weights:
        shape, dtype = _shape_and_dtype(weights, name)  # (its values are read by ``rows``)
        count = shape[0]
        picked = torch.arange(0, count, max(1, count // CHECKED_ROWS))
        if len(shape) != 2 or shape[1] != quant.in_features or dtype != torch.float32 \
                or not torch.equal(quant.dequantize(offset + picked), rows(name, picked)):
            raise KernelUnavailable(f"the GGUF blocks of {', '.join(group.gguf)} differ from the loaded fp32 weights")
        offset += count
    if offset != quant.out_features:
        raise KernelUnavailable(f"the GGUF blocks of {', '.join(group.gguf)} have {quant.out_features} rows, "
                                f"the fp32 weights {offset}")


def _shape_and_dtype(weights: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """A weight's shape and dtype, without decoding it when it is an expert read from a GGUF."""
    if isinstance(weights, WeightsWithExperts) and name in weights.experts and name not in weights.weights:
        expert = weights.experts[name]
        return (expert.rows, expert.columns), torch.float32
    return tuple(weights[name].shape), weights[name].dtype


def held_weights(quantized: Mapping[BlockGroup, QuantizedLinear]) -> set[str]:
    """The fp32 parameters the blocks stand for."""
    return {name for group in quantized for name in group.weights}


def release_weights(model: nn.Module, names: Iterable[str]) -> None:
    """Make the parameters ``names`` empty tensors (no memory; on the meta device before ``to_empty``,
    nothing is ever allocated for them). Tied parameters are one object: both go."""
    for name in names:
        param = model.get_parameter(name)
        param.data = param.data.new_empty(0)


def attach_quantized(model: nn.Module, quantized: Mapping[BlockGroup, QuantizedLinear]) -> int:
    """Hand each group's blocks to its owner, which computes from them from now on, and release the fp32
    weights they stand for (fused ones included). Returns the number of groups attached."""
    for group, quant in quantized.items():
        owner = model.get_submodule(group.owner)
        setattr(owner, group.attr, quant)
        if group.fused is not None and getattr(owner, group.fused, None) is not None:
            setattr(owner, group.fused, getattr(owner, group.fused).new_empty(0))
        release_weights(model, group.weights)
    return len(quantized)


def detach_quantized(model: nn.Module) -> None:
    """Back to fp32 products everywhere: each released fp32 weight rebuilt from its blocks (bit-identical),
    then the blocks dropped."""
    model.layer_stack = None  # (it reads the blocks)
    for group in block_groups(model.config):
        owner = model.get_submodule(group.owner)
        quant = getattr(owner, group.attr, None)
        if quant is not None:
            _restore(model, owner, group, quant)
            setattr(owner, group.attr, None)


def _restore(model: nn.Module, owner: nn.Module, group: BlockGroup, quant: QuantizedLinear) -> None:
    params = [model.get_parameter(name) for name in group.weights]
    if all(param.numel() for param in params):
        return  # kept (or restored through a tied group)
    weight = quant.dequantize()  # [N, K]: every part's rows, in order
    offset = 0
    for name, param in zip(group.weights, params):
        module = model.get_submodule(name.rpartition(".")[0])
        rows = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
        param.data = weight[offset:offset + rows]
        offset += rows
    if group.fused is not None:
        setattr(owner, group.fused, weight)
