"""Tiny random DFlash2 drafters written in the public format (config.json + model.safetensors with
the z-lab / vLLM tensor names), and target + DFlash2 drafter pairs for the engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.dflash_helpers import (
    TinyPair,
    drafter_weight_shapes,
    random_drafter_weights,
    tiny_drafter_config,
    tiny_pair,
    write_drafter,
)

# the tiny drafters' DFlash2 numbers: hidden 32 (tests.helpers' targets) in groups of 8, 2 taps, rank 8
DFLASH2_KEYS = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4,
                "output_multiplier": 0.75, "final_logit_softcapping": 6.0}


def tiny_dflash2_config(target: Any, block_size: int = 4, layers: int = 1, **dflash2_keys) -> dict:
    """A DFlash2 config.json dict for ``target`` (keys inside ``dflash_config``, as the public
    checkpoints have them; a value None leaves the key out)."""
    config = tiny_drafter_config(target, block_size, layers, layout="rope_parameters")
    config["architectures"] = ["DFlash2DraftModel"]
    config.update(is_causal=False, hidden_act="silu")
    keys = {**DFLASH2_KEYS, **dflash2_keys}
    config["dflash_config"].update({k: v for k, v in keys.items() if v is not None})
    config["dflash_config"]["block_size"] = config.pop("block_size")
    return config


def dflash2_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The public tensor names and shapes a DFlash2 config implies (written from the format,
    independently of flashtree's module tree)."""
    draft = config["dflash_config"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    taps, groups, rank = draft["conv_kernel_size"], hidden // draft["conv_group_size"], draft["selector_rank"]
    shapes = drafter_weight_shapes(config | {"block_size": draft["block_size"]})
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
    shapes.update({"candidate_selector.hidden_projection.weight": (rank, hidden),
                   "candidate_selector.predecessor_codebook": (vocab, rank),
                   "candidate_selector.successor_codebook": (vocab, rank)})
    return shapes


def random_dflash2_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights whose convolutions and selector move the draft: base taps near identity for
    the current slot and about 0.5 for the previous one, codebooks of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    weights = random_drafter_weights(config, seed)
    for name, shape in dflash2_weight_shapes(config).items():
        if name in weights:
            continue
        if name.endswith("base_kernel"):
            base = 0.3 * torch.randn(shape, generator=gen)
            base[:, 0] += 1.0
            weights[name] = base
        elif name.endswith("codebook"):
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.2 * torch.randn(shape, generator=gen)
    return weights


def save_tiny_dflash2(target: Any, out_dir: str | Path, block_size: int = 4, layers: int = 1, seed: int = 0,
                      **dflash2_keys) -> Path:
    """Write a random DFlash2 drafter for ``target`` (a directory, a config object or a dict)."""
    config = tiny_dflash2_config(target, block_size, layers, **dflash2_keys)
    return write_drafter(out_dir, config, random_dflash2_weights(config, seed))


def tiny_dflash2_pair(tmp_path: str | Path, family: str = "qwen3_qknorm", vocab: int = 32, target_layers: int = 3,
                      block_size: int = 4, drafter_layers: int = 1, seed: int = 0, tokenizer: bool = True,
                      **dflash2_keys) -> TinyPair:
    """A tiny random target (``tests.helpers`` family) and a random DFlash2 drafter for it."""
    return tiny_pair(tmp_path, family, vocab, target_layers, block_size, drafter_layers, seed, tokenizer,
                     save_drafter=save_tiny_dflash2, drafter_name="dflash2", **dflash2_keys)
