"""Which drafter a checkpoint holds: :func:`load_drafter` reads config.json's ``architectures`` and
loads a first-generation DFlash drafter (``dflash.py``) or a DFlash2 drafter (``dflash2.py``)."""

from __future__ import annotations

import torch

from flashtree.errors import ConfigError
from flashtree.models import dflash
from flashtree.models.dflash2 import load_dflash2_drafter
from flashtree.models.dflash_config import is_dflash2
from flashtree.models.loader import read_json
from flashtree.models.transformer import CausalLM


def load_drafter(path_or_hub_id: str, target: CausalLM, tokenizer=None, block_size_override: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 random_weights: bool = False, seed: int = 0) -> dflash.DFlashDrafter:
    """The drafter in ``path_or_hub_id`` (a directory or a hub id) for ``target``, whichever
    generation its config.json declares (arguments as in :func:`flashtree.models.dflash.load_drafter`)."""
    directory = dflash.resolve_drafter_dir(path_or_hub_id, need_weights=not random_weights)
    config_path = directory / "config.json"
    raw = read_json(config_path, ConfigError) if config_path.is_file() else {}
    if isinstance(raw, dict) and is_dflash2(raw):
        return load_dflash2_drafter(directory, raw, target, tokenizer, block_size_override, device, dtype,
                                    random_weights=random_weights, seed=seed)
    return dflash.load_drafter(str(directory), target, tokenizer, block_size_override, device, dtype,
                               random_weights=random_weights, seed=seed)
