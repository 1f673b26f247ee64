"""Tensors and rows of a safetensors file read with plain file reads.

Nothing of the file is mapped into memory, so only what is read is resident, in tensors of the
caller's. (A read through a memory map, as ``safetensors.safe_open`` does, keeps the pages around every
touched row mapped, 64 KB or more each, for as long as any tensor of the file lives.) The format: an
8-byte little-endian header size, a JSON header (name -> dtype, shape, data offsets; ``__metadata__``),
then the data.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"F32": torch.float32, "U8": torch.uint8}  # the element types read here


class SafetensorsFile:
    """The header of a safetensors file, and reads of its tensors' bytes."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.path = Path(path)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header  # name -> {"dtype", "shape", "data_offsets"}
        self._data_start = 8 + size

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def file_offset(self, name: str) -> int:
        """Where the tensor's bytes start in the file."""
        return self._data_start + self.entries[name]["data_offsets"][0]

    def read_into(self, name: str, out: torch.Tensor, first_row: int = 0) -> None:
        """Fill the contiguous 2-D ``out`` (the tensor's dtype and row width) with its rows from ``first_row`` on."""
        with open(self.path, "rb") as f:
            self._read(f, name, out, first_row)

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The given rows of a 2-D tensor: ``[len(rows), K]``."""
        out = torch.empty(len(rows), self.shape(name)[1], dtype=DTYPES[self.entries[name]["dtype"]])
        with open(self.path, "rb") as f:
            for i, row in enumerate(rows.tolist()):
                self._read(f, name, out[i:i + 1], row)
        return out

    def _read(self, f, name: str, out: torch.Tensor, first_row: int) -> None:
        entry = self.entries[name]
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        offset = begin + first_row * out.shape[1] * out.element_size()
        nbytes = out.numel() * out.element_size()
        if DTYPES.get(entry["dtype"]) != out.dtype or out.dim() != 2 or not out.is_contiguous() \
                or len(shape) != 2 or out.shape[1] != shape[1] or offset + nbytes > end:
            raise ValueError(f"{self.path}: {name} ({entry['dtype']} {shape}) has no rows {first_row}.. "
                             f"of {out.dtype} {list(out.shape)}")
        f.seek(self._data_start + offset)
        if f.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B")) != nbytes:
            raise OSError(f"{self.path}: truncated at {name}")
