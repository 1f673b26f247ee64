"""A GGUF model's quantized matrices kept as raw blocks for the CPU block kernel (:mod:`flashtree.kernels.cpu.quant_linear`).

The GGUF conversion writes ``gguf_blocks.safetensors`` beside the fp32 weights (the first load of an
older cache entry adds it). :func:`load_blocks` lists its matrices; each is read on request into a
tensor of the caller's with plain file reads (``safetensors_reads.py``: nothing of the file stays
mapped, so only the blocks a model keeps are resident). ``quantized_weights.py`` decides which a model
holds and checks them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from flashtree.kernels.cpu.library import KernelUnavailable
from flashtree.kernels.cpu.quant_linear import BLOCK_TYPES
from flashtree.models.gguf_layout import unpermute_for_hf
from flashtree.models.safetensors_reads import SafetensorsFile

log = logging.getLogger("flashtree")

BLOCKS_FILE = "gguf_blocks.safetensors"  # beside model.safetensors in the conversion cache


def gguf_blocks(reader, architecture: str, heads: int, kv_heads: int) -> dict[str, tuple[str, np.ndarray]]:
    """Every matrix of an open GGUF file in a type the block kernel reads (``BLOCK_TYPES``): GGUF name ->
    (type name, raw blocks ``uint8 [rows, K / weights per block * block bytes]``), the q/k rows un-permuted like the converter does
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
                "source": json.dumps(_source_key(source)), "collected": json.dumps(sorted(BLOCK_TYPES))}
    tmp = out_dir / f".{BLOCKS_FILE}.{os.getpid()}.tmp"
    safetensors.numpy.save_file({name: raw for name, (_, raw) in blocks.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, out_dir / BLOCKS_FILE)


def _source_key(source: dict) -> list:
    return [source.get("path"), source.get("size"), source.get("mtime_ns")]


def source_unchanged(source: dict) -> bool:
    """The GGUF a conversion's source record names is still there, the same size and modification time."""
    path = Path(source.get("path") or "")
    return path.is_file() and path.stat().st_size == source.get("size") and path.stat().st_mtime_ns == source.get("mtime_ns")


class StoredMatrix(NamedTuple):
    """One quantized matrix of a GGUF: its type, size, and how to read its raw blocks."""

    type_name: str  # a key of BLOCK_TYPES (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q6_K)
    rows: int
    row_bytes: int  # K / 32 blocks (K / 256 super-blocks) of the type's size
    read_into: Callable[[torch.Tensor], None]  # fills a contiguous uint8 [rows, row_bytes] tensor

    @property
    def in_features(self) -> int:
        block_type = BLOCK_TYPES[self.type_name]
        return self.row_bytes // block_type.block_bytes * block_type.weights


def load_blocks(model_dir: Path, source: dict, architecture: str, heads: int, kv_heads: int) -> dict[str, StoredMatrix]:
    """The quantized matrices of a converted GGUF by GGUF name: from ``gguf_blocks.safetensors`` in
    its cache directory, written from the GGUF itself (and kept for next time) when missing or stale."""
    path = model_dir / BLOCKS_FILE
    if path.is_file():
        try:
            stored = read_block_file(path, source)
        except (OSError, ValueError, KeyError, TypeError):
            stored = None
        if stored is not None:
            return stored
    import gguf

    gguf_path = Path(source["path"])
    if not source_unchanged(source):
        raise KernelUnavailable(f"{gguf_path} changed or is gone since it was converted")
    raw = gguf_blocks(gguf.GGUFReader(str(gguf_path)), architecture, heads, kv_heads)
    try:
        save_blocks(raw, model_dir, source)
    except OSError as err:  # a read-only cache: fine, read the GGUF again next time
        log.info("flashtree: cannot cache the GGUF blocks in %s: %s", model_dir, err)
    return {name: StoredMatrix(type_name, *array.shape, _copier(array)) for name, (type_name, array) in raw.items()}


def _copier(array: np.ndarray) -> Callable[[torch.Tensor], None]:
    return lambda out: out.copy_(torch.from_numpy(array))


def read_block_file(path: Path, source: dict) -> dict[str, StoredMatrix] | None:
    """The matrices listed in a ``gguf_blocks.safetensors``, each read on request with plain file reads;
    None when the file was written from another GGUF or collected other types than ``BLOCK_TYPES``."""
    stored = SafetensorsFile(path)
    if json.loads(stored.metadata.get("source", "null")) != _source_key(source) \
            or json.loads(stored.metadata.get("collected", '["Q4_0", "Q4_1", "Q8_0"]')) != sorted(BLOCK_TYPES):
        return None  # another GGUF's, or collected when the kernel read fewer types
    types = json.loads(stored.metadata["types"])
    found = {}
    for name in stored.entries:
        shape = stored.shape(name)
        if types[name] not in BLOCK_TYPES or len(shape) != 2:
            raise ValueError(f"{path}: {name} is not a matrix of GGUF blocks")
        found[name] = StoredMatrix(types[name], *shape, functools.partial(stored.read_into, name))
    return found
