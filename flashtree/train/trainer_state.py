"""The trainer's state for resuming a run exactly, in ``<checkpoint>/trainer_state/``.

- ``state.json``: the scalar state: step, elapsed seconds, the data position, the metrics
  history, the TrainConfig, the optimizer's param groups, Python's and NumPy's RNG states, and
  the index of the tensors;
- ``tensors-0000i-of-0000n.safetensors``: float32 master weights (``model/<name>``), the
  optimizer's per-parameter tensors (``optimizer/<param index>/<key>``) and the torch RNG
  states (``rng/torch_cpu``, ``rng/torch_cuda/<device>``, ``rng/anchors``: the anchor sampler's
  generator), each file at most ``max_shard_bytes`` (16 MiB: what a device call brings back).

No pickle: ``json`` and ``safetensors`` read it all. A save writes a fresh folder and swaps it in
(the previous state survives as ``trainer_state.old`` until the swap is done), so a run killed
while saving still resumes from the state before.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from flashtree.errors import CheckpointError
from flashtree.train.tensor_shards import read_shards, write_shards

STATE_DIR = "trainer_state"
STATE_JSON = "state.json"
FORMAT_VERSION = 1
MAX_SHARD_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass
class TrainerState:
    """Everything a resumed run needs besides the config and the data."""

    step: int
    elapsed_s: float
    data_position: dict  # {"epoch", "batch", "fingerprint"}: the next batch of the stream
    history: list[dict]
    train_config: dict
    model: dict[str, torch.Tensor]  # float32 master weights by z-lab name
    optimizer: dict  # torch optimizer state_dict
    rng: dict  # {"torch_cpu", "torch_cuda": [...], "anchors", "python", "numpy"}


# ---------------------------------------------------------------------------- RNG
def capture_rng(anchors: torch.Generator) -> dict:
    """Every random state the training loop can draw from."""
    rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "anchors": anchors.get_state(),
                           "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
                           "python": _python_rng()}
    numpy_state = _numpy_rng()
    if numpy_state is not None:
        rng["numpy"] = numpy_state
    return rng


def restore_rng(rng: dict, anchors: torch.Generator) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    anchors.set_state(rng["anchors"])
    if rng.get("torch_cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["torch_cuda"][:torch.cuda.device_count()])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if rng.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng() -> list | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


# ---------------------------------------------------------------------------- optimizer
def _split_optimizer(state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part, tensors) of a torch optimizer state_dict."""
    tensors, scalars = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"optimizer/{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return {"param_groups": state_dict["param_groups"], "scalars": scalars}, tensors


def _join_optimizer(meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split("/", 2)
        state.setdefault(int(index), {})[key] = value
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------- files
def save(directory: str | Path, state: TrainerState, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``state`` into ``directory/trainer_state`` (swapped in whole)."""
    final = Path(directory) / STATE_DIR
    fresh, old = final.with_name(STATE_DIR + ".tmp"), final.with_name(STATE_DIR + ".old")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    optimizer_meta, optimizer_tensors = _split_optimizer(state.optimizer)
    rng = dict(state.rng)
    tensors = {**{f"model/{k}": v for k, v in state.model.items()}, **optimizer_tensors,
               "rng/torch_cpu": rng.pop("torch_cpu"), "rng/anchors": rng.pop("anchors"),
               **{f"rng/torch_cuda/{i}": t for i, t in enumerate(rng.pop("torch_cuda"))}}
    index = write_shards(fresh, tensors, max_shard_bytes)
    meta = {"format": FORMAT_VERSION, "step": state.step, "elapsed_s": state.elapsed_s,
            "data_position": state.data_position, "history": state.history, "train_config": state.train_config,
            "optimizer": optimizer_meta, "rng": rng, "tensors": index}
    (fresh / STATE_JSON).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    fresh.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def state_dir(directory: str | Path) -> Path | None:
    """The trainer-state folder of a checkpoint (the previous one if a save was cut short), or None."""
    for name in (STATE_DIR, STATE_DIR + ".old"):
        path = Path(directory) / name
        if (path / STATE_JSON).is_file():
            return path
    return None


def load(directory: str | Path) -> TrainerState | None:
    """The trainer state of a checkpoint directory, or None when it has none (a z-lab drafter)."""
    path = state_dir(directory)
    if path is None:
        return None
    try:
        meta = json.loads((path / STATE_JSON).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / STATE_JSON}: cannot read the trainer state ({err})") from err
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path / STATE_JSON}: trainer-state format {meta.get('format')!r}; "
                              f"this flashtree reads format {FORMAT_VERSION}")
    tensors = read_shards(path, meta["tensors"])
    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    optimizer = _join_optimizer(meta["optimizer"], {k: v for k, v in tensors.items() if k.startswith("optimizer/")})
    cuda = sorted((k for k in tensors if k.startswith("rng/torch_cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    rng = {**meta["rng"], "torch_cpu": tensors["rng/torch_cpu"], "anchors": tensors["rng/anchors"],
           "torch_cuda": [tensors[k] for k in cuda]}
    return TrainerState(int(meta["step"]), float(meta["elapsed_s"]), meta["data_position"], list(meta["history"]),
                        meta["train_config"], model, optimizer, rng)
