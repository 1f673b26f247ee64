"""Drafter checkpoints in the z-lab format, plus the trainer's own state for resuming.

A checkpoint directory holds
- ``config.json``: the drafter config (architectures ["DFlashDraftModel"], model_type "qwen3",
  block_size, num_target_layers, dflash_config {mask_token_id, target_layer_ids, mask_token});
- ``model.safetensors`` (or shards + ``model.safetensors.index.json`` with ``max_shard_mb``):
  the drafter's own tensors only, never the embedding or lm_head (those are the target's);
- ``trainer_state/``: what ``--resume`` needs to continue the run exactly (safetensors shards
  and JSON, see :mod:`flashtree.train.trainer_state`; the inference loader never reads it);
- ``train_metrics.json`` and ``train_curve.png``: the metrics history and its plot, for people.
Files are written under temporary names and renamed into place, so an interrupted save never
leaves a half-written file where a loader would read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from flashtree.errors import CheckpointError
from flashtree.models.loader import (
    SHARDED_INDEX_FILE,
    SINGLE_WEIGHTS_FILE,
    read_json,
    read_weights,
)

CONFIG_FILE = "config.json"
LEGACY_STATE_FILE = "trainer_state.pt"  # older runs: pickled, no longer read
METRICS_FILE = "train_metrics.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"


def drafter_tensors(drafter: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's parameters by z-lab name, detached, contiguous, on the CPU, in ``dtype``."""
    return {name: p.detach().to("cpu", dtype).contiguous() for name, p in drafter.named_parameters()}


def save_drafter(out_dir: str | Path, raw_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 max_shard_mb: float | None = None) -> int:
    """Write config.json and the weights (one file, or shards under ``max_shard_mb``); returns
    the weight bytes written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / CONFIG_FILE, json.dumps(raw_config, indent=2) + "\n")
    shards = _shards(tensors, max_shard_mb)
    _remove_weights(out)
    if len(shards) == 1:
        _write_safetensors(out / SINGLE_WEIGHTS_FILE, shards[0])
    else:
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            name = _SHARD_NAME.format(index=index, count=len(shards))
            _write_safetensors(out / name, shard)
            weight_map.update({tensor: name for tensor in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_text(out / SHARDED_INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2) + "\n")
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weights_bytes(directory: str | Path) -> int:
    """Bytes of the safetensors files in a checkpoint directory."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def read_drafter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, weights) of a drafter directory (ours or a z-lab one)."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory}: config.json not found; --resume needs a drafter checkpoint directory")
    return read_json(directory / CONFIG_FILE, CheckpointError), read_weights(directory)


def remove_legacy_state(out_dir: str | Path) -> None:
    """An older flashtree's pickled ``trainer_state.pt``: stale once a new state is written."""
    path = Path(out_dir) / LEGACY_STATE_FILE
    if path.is_file():
        path.unlink()


def save_metrics(out_dir: str | Path, metrics: dict[str, Any]) -> None:
    _write_text(Path(out_dir) / METRICS_FILE, json.dumps(metrics, indent=2) + "\n")


def _shards(tensors: dict[str, torch.Tensor], max_shard_mb: float | None) -> list[dict[str, torch.Tensor]]:
    if max_shard_mb is None:
        return [tensors]
    limit = max_shard_mb * 1024 * 1024
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _remove_weights(directory: Path) -> None:
    """Old weight files, so a loader never mixes a stale single file with new shards."""
    for path in [directory / SINGLE_WEIGHTS_FILE, directory / SHARDED_INDEX_FILE,
                 *directory.glob("model-*-of-*.safetensors")]:
        if path.is_file():
            path.unlink()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
