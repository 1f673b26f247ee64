"""A Qwen3-MoE GGUF's expert matrices, read from the GGUF file itself.

The experts are nearly all of a MoE model's bytes (Qwen3-30B-A3B: 128 experts a layer, 29 of its 30
billion weights), so the conversion (``gguf_convert.py``) never writes them to its float32 cache:
that would take four times the GGUF's size per weight of Q4 (about 120 GB for a 30B-A3B). Instead the
converted config lists ``flashtree_source_gguf.experts_in_gguf`` and the loader reads each expert's
rows from the GGUF on demand:

- :class:`ExpertMatrix`: one expert's ``[rows, columns]`` slice of a stacked
  ``blk.N.ffn_{gate,up,down}_exps.weight`` tensor (``[experts, rows, columns]``, GGUF's fastest
  dimension last), its raw bytes at a file offset;
- :class:`WeightsWithExperts`: a checkpoint's weights mapping whose expert entries are dequantized
  to float32 (gguf-py, as the converter would) only when read, one at a time, so a model built on
  a GPU never holds more than one float32 expert on the host;
- on the CPU in float32, experts of the types the block kernel runs (``BLOCK_TYPES``) compute from
  their raw blocks (``quantized_weights.py``), and no float32 copy of them is ever made.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from flashtree.errors import CheckpointError

# stacked expert tensors -> the per-expert projection they hold
EXPERT_PROJECTIONS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")


def expert_tensor_names(gguf_name: str) -> str | None:
    """``blk.3.ffn_gate_exps.weight`` -> ``model.layers.3.mlp.experts.{expert}.gate_proj.weight`` (a
    format string over the expert), or None for a tensor that is not a MoE layer's experts."""
    match = _EXPERT_TENSOR.match(gguf_name)
    if match is None:
        return None
    layer, part = match.groups()
    return f"model.layers.{layer}.mlp.experts.{{expert}}.{EXPERT_PROJECTIONS[part]}.weight"


class ExpertMatrix(NamedTuple):
    """One expert's matrix inside a GGUF file."""

    gguf_path: Path
    type_name: str  # GGML type: Q4_0, Q4_K, F16 ...
    offset: int  # file offset of its first row
    rows: int
    columns: int
    row_bytes: int

    def raw(self) -> np.ndarray:
        """Its bytes ``uint8 [rows, row_bytes]`` (plain file reads, no map)."""
        data = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        self.read_into(torch.from_numpy(data))
        return data

    def read_into(self, out: torch.Tensor) -> None:
        """Fill the contiguous ``uint8 [rows, row_bytes]`` tensor ``out`` with its raw bytes."""
        with open(self.gguf_path, "rb") as f:
            f.seek(self.offset)
            if f.readinto(memoryview(out.numpy()).cast("B")) != self.rows * self.row_bytes:
                raise CheckpointError(f"{self.gguf_path}: truncated in an expert matrix; re-download it")

    def dequantized_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(rows), columns]``: the given rows decoded as the converter decodes a matrix."""
        import gguf

        picked = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        with open(self.gguf_path, "rb") as f:
            for i, row in enumerate(rows.tolist()):
                f.seek(self.offset + row * self.row_bytes)
                if f.readinto(memoryview(picked[i])) != self.row_bytes:
                    raise CheckpointError(f"{self.gguf_path}: truncated in an expert matrix; re-download it")
        values = gguf.quants.dequantize(picked, gguf.GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1, self.columns))

    def dequantized(self) -> torch.Tensor:
        """The whole matrix in float32 ``[rows, columns]``."""
        import gguf

        values = gguf.quants.dequantize(self.raw(), gguf.GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.rows, self.columns))


def expert_matrices(gguf_path: Path) -> dict[str, ExpertMatrix]:
    """Every expert matrix of a GGUF, by the Hugging Face name of its parameter
    (``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``)."""
    import gguf

    found = {}
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        names = expert_tensor_names(tensor.name)
        if names is None:
            continue
        experts, rows, columns = (int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest first
        row_bytes = int(tensor.n_bytes) // (experts * rows)
        for expert in range(experts):
            name = names.format(expert=expert)
            offset = int(tensor.data_offset) + expert * rows * row_bytes
            found[name] = ExpertMatrix(Path(gguf_path), tensor.tensor_type.name, offset, rows, columns, row_bytes)
    return found


class WeightsWithExperts(Mapping):
    """``weights`` (the converted tensors) and the ``experts`` read from the GGUF: an expert's float32
    tensor is made when it is looked up and not kept."""

    def __init__(self, weights: Mapping[str, torch.Tensor], experts: Mapping[str, ExpertMatrix]):
        self.weights, self.experts = weights, experts

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.weights:
            return self.weights[name]
        return self.experts[name].dequantized()

    def __contains__(self, name: object) -> bool:
        return name in self.weights or name in self.experts

    def __iter__(self) -> Iterator[str]:
        yield from self.weights
        yield from (name for name in self.experts if name not in self.weights)

    def __len__(self) -> int:
        return len(self.weights) + sum(1 for name in self.experts if name not in self.weights)
