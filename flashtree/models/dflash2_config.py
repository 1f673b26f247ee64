"""DFlash2Config: a second-generation DFlash drafter's ``config.json``, checked against its target.

A DFlash2 config is a DFlash config (``dflash_config.py`` validates the shared keys: shape, RoPE,
block size, target layer ids, mask token, layer types and sliding window) whose ``architectures``
holds ``DFlash2DraftModel`` and whose ``dflash_config`` section adds the keys below. Each is read
from ``dflash_config`` first, then from the top level (some exports put it there).

Keys (see ``models/dflash2.py`` for what each one does)
- ``conv_kernel_size`` (required, int >= 1): taps of the grouped local convolutions.
- ``conv_group_size`` (required, int >= 1 dividing ``hidden_size``): channels that share one
  input-dependent tap coefficient.
- ``selector_rank`` (required, int >= 1): width of the candidate selector's codebooks.
- ``selector_top_k`` (required, int in [1, vocabulary]): candidates per draft position.
- ``output_multiplier`` (default 1.0, a positive number): scales the draft logits.
- ``final_logit_softcapping`` (default none; 0 or null: none): the cap c of
  ``c * tanh(logit / c)``, applied after the multiplier.
- ``input_embedding_scale`` (default 1.0, a positive number): scales the block's embeddings.
- top level: ``is_causal`` must be false or absent (the block attends to itself non-causally),
  ``hidden_act`` must be ``silu`` or absent, ``vocab_size`` (when present) must equal the target's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flashtree.errors import ConfigError
from flashtree.models.config import ModelConfig
from flashtree.models.dflash_config import (
    DFLASH2_ARCHITECTURE,
    DFlashConfig,
    is_dflash2,
    parse_dflash_config,
)


@dataclasses.dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """A validated DFlash2 config (built only by :func:`parse_dflash2_config`)."""

    vocab_size: int  # the target's: rows of the selector's codebooks
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: float | None  # None: no cap
    input_embedding_scale: float

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


def parse_dflash2_config(raw: Mapping[str, Any], source: str, target_config: ModelConfig, tokenizer=None,
                         block_size_override: int | None = None) -> DFlash2Config:
    """Validate a DFlash2 ``config.json`` dict against its target (arguments as in
    :func:`~flashtree.models.dflash_config.parse_dflash_config`)."""
    if not is_dflash2(raw):
        raise ConfigError(f"{source}: 'architectures' = {raw.get('architectures')!r} is not a DFlash2 drafter; "
                          f"allowed: [{DFLASH2_ARCHITECTURE!r}]")
    draft = raw.get("dflash_config")
    if not isinstance(draft, Mapping):
        raise ConfigError(f"{source}: 'dflash_config' = {draft!r} is not valid; allowed: an object with "
                          f"conv_kernel_size, conv_group_size, selector_rank, selector_top_k, mask_token_id, ...")
    base = parse_dflash_config(raw, source, target_config, tokenizer, block_size_override, dflash2=True)
    _check_block_semantics(raw, source)
    read = _Reader(raw, draft, source)
    vocab = target_config.vocab_size
    _check_vocab(raw, vocab, source)
    group = read.int_at_least("conv_group_size", 1)
    if base.hidden_size % group:
        read.fail("conv_group_size", group, f"a divisor of hidden_size ({base.hidden_size})")
    top_k = read.int_at_least("selector_top_k", 1)
    if top_k > vocab:
        read.fail("selector_top_k", top_k, f"an integer in [1, {vocab}] (the target's vocabulary size)")
    shared = {field.name: getattr(base, field.name) for field in dataclasses.fields(base)}
    return DFlash2Config(
        **shared, vocab_size=vocab, conv_kernel_size=read.int_at_least("conv_kernel_size", 1),
        conv_group_size=group, selector_rank=read.int_at_least("selector_rank", 1), selector_top_k=top_k,
        output_multiplier=read.positive("output_multiplier", 1.0),
        final_logit_softcapping=read.softcap("final_logit_softcapping"),
        input_embedding_scale=read.positive("input_embedding_scale", 1.0))


class _Reader:
    """Reads a DFlash2 key from ``dflash_config``, else the top level; errors name the file, the
    key, the value and what is allowed."""

    def __init__(self, raw: Mapping[str, Any], draft: Mapping[str, Any], source: str):
        self.raw, self.draft, self.source = raw, draft, source

    def key(self, name: str) -> str:
        return f"dflash_config.{name}" if name in self.draft or name not in self.raw else name

    def value(self, name: str) -> Any:
        return self.draft[name] if name in self.draft else self.raw.get(name)

    def fail(self, name: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{self.source}: {self.key(name)!r} = {value!r} is not valid; allowed: {allowed}")

    def int_at_least(self, name: str, minimum: int) -> int:
        value = self.value(name)
        if value is None:
            raise ConfigError(f"{self.source}: required key 'dflash_config.{name}' is missing (a DFlash2 drafter "
                              f"needs it); allowed: an integer >= {minimum}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(name, value, f"an integer >= {minimum}")
        return value

    def positive(self, name: str, default: float) -> float:
        value = self.value(name)
        if value is None:
            return default
        if not _is_number(value) or not value > 0:
            self.fail(name, value, f"a positive finite number (default {default})")
        return float(value)

    def softcap(self, name: str) -> float | None:
        value = self.value(name)
        if value is None:
            return None
        if not _is_number(value) or value < 0:
            self.fail(name, value, "a finite number >= 0 (0 or null: no soft cap)")
        return float(value) if value > 0 else None


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_block_semantics(raw: Mapping[str, Any], source: str) -> None:
    """The block pass DFlash2 defines: non-causal attention, SiLU-gated MLPs."""
    causal = raw.get("is_causal")
    if causal not in (None, False):
        raise ConfigError(f"{source}: 'is_causal' = {causal!r} is not valid; allowed: false or absent (a DFlash2 "
                          f"block attends to all of itself)")
    act = raw.get("hidden_act")
    if act not in (None, "silu"):
        raise ConfigError(f"{source}: 'hidden_act' = {act!r} is not valid; allowed: 'silu' or absent")


def _check_vocab(raw: Mapping[str, Any], vocab: int, source: str) -> None:
    """The selector's codebooks are indexed by the target's token ids."""
    recorded = raw.get("vocab_size")
    if recorded is not None and recorded != vocab:
        raise ConfigError(f"{source}: 'vocab_size' = {recorded!r} is not valid; allowed: {vocab}, the target's "
                          f"vocabulary size (the candidate selector's codebooks have one row per target token)")
