"""A flat dict of tensors as safetensors files of at most ``max_bytes`` each (the whole file,
header included), read back bit for bit with nothing but ``safetensors`` and ``json``.

A tensor larger than one shard's room is flattened and cut into pieces (``name::part<k>``), each
stored as its own safetensors entry; the index (a JSON-able dict the caller stores) lists, per
tensor, its shape, dtype and the (file, key) of each piece in order. Shards are numbered
``<prefix>-00001-of-0000N.safetensors``.
"""

from __future__ import annotations

import math
from pathlib import Path

import safetensors.torch
import torch

from flashtree.errors import CheckpointError

HEADER_ROOM = 64 * 1024  # bytes kept in every shard for its JSON header (names, shapes, offsets)
ENTRY_HEADER_BYTES = 128  # a generous header size of one entry, besides its key
FILE_NAME = "{prefix}-{index:05d}-of-{count:05d}.safetensors"


def _pieces(name: str, tensor: torch.Tensor, room: int) -> list[tuple[str, torch.Tensor]]:
    """(key, 1-D or whole tensor) pieces of at most ``room`` bytes each."""
    tensor = tensor.detach().to("cpu").contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= room:
        return [(name, tensor)]
    per_piece = max(1, room // tensor.element_size())
    flat = tensor.reshape(-1)
    count = math.ceil(flat.numel() / per_piece)
    return [(f"{name}::part{k}", flat[k * per_piece:(k + 1) * per_piece].clone()) for k in range(count)]


def _entry_bytes(key: str, piece: torch.Tensor) -> int:
    return piece.numel() * piece.element_size() + len(key.encode("utf-8")) + ENTRY_HEADER_BYTES


def write_shards(directory: str | Path, tensors: dict[str, torch.Tensor], max_bytes: int,
                 prefix: str = "tensors") -> dict:
    """Write ``tensors`` into ``directory`` as shards of at most ``max_bytes``; returns the index
    ``{name: {"shape", "dtype", "parts": [[file, key], ...]}}``."""
    room = max_bytes - HEADER_ROOM
    if room < 1024:
        raise ValueError(f"max_bytes={max_bytes} leaves no room for tensors (a shard keeps {HEADER_ROOM} for its header)")
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    placed: dict[str, list[tuple[int, str]]] = {}
    for name, tensor in tensors.items():
        for key, piece in _pieces(name, tensor, room - ENTRY_HEADER_BYTES - len(name) - 16):
            size = _entry_bytes(key, piece)
            if shards[-1] and used + size > room:
                shards.append({})
                used = 0
            shards[-1][key] = piece
            used += size
            placed.setdefault(name, []).append((len(shards) - 1, key))
    names = [FILE_NAME.format(prefix=prefix, index=i + 1, count=len(shards)) for i in range(len(shards))]
    directory = Path(directory)
    for name, shard in zip(names, shards):
        safetensors.torch.save_file(shard, str(directory / name), metadata={"format": "pt"})
    return {name: {"shape": list(tensors[name].shape), "dtype": str(tensors[name].dtype).removeprefix("torch."),
                   "parts": [[names[i], key] for i, key in parts]} for name, parts in placed.items()}


def read_shards(directory: str | Path, index: dict) -> dict[str, torch.Tensor]:
    """The tensors an index of :func:`write_shards` lists, from the shards in ``directory``."""
    directory = Path(directory)
    files: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, entry in index.items():
        pieces = []
        for file, key in entry["parts"]:
            if file not in files:
                path = directory / file
                if not path.is_file():
                    raise CheckpointError(f"{directory}: shard {file} (tensor {name!r}) is missing")
                try:
                    files[file] = safetensors.torch.load_file(str(path))
                except (safetensors.SafetensorError, OSError) as err:
                    raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({err})") from err
            pieces.append(files[file][key])
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        out[name] = tensor.reshape(entry["shape"])
    return out
