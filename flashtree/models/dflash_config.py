"""DFlashConfig: a DFlash drafter's ``config.json`` (z-lab format), checked against its target.

:func:`parse_dflash_config` is the one place where a drafter config is validated; every error
names the file, the key, the value and what is allowed. A drafter made for another target is
refused here, before anything is generated.

Glossary
- target layer ids: target decoder layers whose outputs (Hugging Face ``hidden_states[id + 1]``)
  are concatenated into the context features, in this order.
- context width: ``len(target_layer_ids) * hidden_size``, the input width of ``fc``.
- mask token: the token in block slots 1..b-1; its embedding is the TARGET's row for
  ``mask_token_id`` (so that id must be below the target's vocabulary size).
- block size: slots of one drafter pass (the bonus token + b-1 masks); the draft horizon is b-1.
  The checkpoint's block size may be lowered at load time (``block_size_override``), never raised.
- layer type: ``full_attention`` (the block sees the whole context) or ``sliding_attention``
  (the block sees only the last ``sliding_window`` context positions).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

from flashtree.errors import ConfigError
from flashtree.models.config import ModelConfig, RopeScaling, rope_settings

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # second generation: models/dflash2_config.py adds its keys
DEFAULT_MASK_TOKEN = "<|MASK|>"
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A validated drafter config (built only by :func:`parse_dflash_config`)."""

    source: str  # the config.json it came from (named in later errors)
    hidden_size: int  # equals the target's
    intermediate_size: int
    num_hidden_layers: int  # drafter layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    attention_bias: bool  # q/k/v/o projections carry a bias
    block_size: int  # slots per drafter pass, after any override
    checkpoint_block_size: int  # the block size the checkpoint was trained with
    num_target_layers: int  # equals the target's layer count
    target_layer_ids: tuple[int, ...]
    mask_token: str
    mask_token_id: int  # < the target's vocabulary size
    layer_types: tuple[str, ...]  # one per drafter layer
    sliding_window: int | None  # set when some layer is sliding_attention

    @property
    def draft_horizon(self) -> int:
        return self.block_size - 1

    @property
    def context_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def window(self, layer: int) -> int | None:
        """Context positions drafter layer ``layer`` sees (None: all)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The spread used when ``target_layer_ids`` is absent (the z-lab format's rule)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def is_dflash2(raw: Mapping[str, Any]) -> bool:
    """The config declares a second-generation drafter (``architectures`` holds DFlash2DraftModel)."""
    architectures = raw.get("architectures") or []
    return isinstance(architectures, (list, tuple)) and DFLASH2_ARCHITECTURE in architectures


def parse_dflash_config(raw: Mapping[str, Any], source: str, target_config: ModelConfig, tokenizer=None,
                        block_size_override: int | None = None, *, dflash2: bool = False) -> DFlashConfig:
    """Validate a drafter ``config.json`` dict against its target.

    ``source`` names the file in errors. ``tokenizer`` (the target's) resolves a missing
    ``mask_token_id``, adding the mask token to it when absent. ``block_size_override`` may
    only lower the checkpoint's ``block_size``. ``dflash2``: the caller validates the keys a
    DFlash2 config shares with the first generation (a DFlash2 config is refused otherwise).
    """
    check = _Checker(source)
    if is_dflash2(raw) and not dflash2:
        raise ConfigError(
            f"{source}: 'architectures' = {raw.get('architectures')!r} declares a DFlash2 drafter, which this "
            f"first-generation DFlash loader does not read; allowed: load it with "
            f"flashtree.models.drafters.load_drafter (what --draft does), or a {DRAFTER_ARCHITECTURE} checkpoint")
    draft = _dflash_section(raw, check)
    shape = _layer_shape(raw, check)
    _check_pair(raw, draft, shape["hidden_size"], target_config, check)
    num_target_layers = target_config.num_hidden_layers
    checkpoint_block = check.int_at_least(_lookup(raw, draft, "block_size"), "block_size", 2)
    theta, scaling = _rope(raw, check)
    layer_types, window = _layer_types(raw, shape["num_hidden_layers"], check)
    mask_token = draft.get("mask_token", DEFAULT_MASK_TOKEN)
    if not isinstance(mask_token, str) or not mask_token:
        check.fail("dflash_config.mask_token", mask_token, "a non-empty string such as '<|MASK|>'")
    return DFlashConfig(
        source=source, **shape, rms_norm_eps=_eps(raw, check), rope_theta=theta, rope_scaling=scaling,
        attention_bias=bool(raw.get("attention_bias", False)),
        block_size=_block_size(checkpoint_block, block_size_override, check),
        checkpoint_block_size=checkpoint_block, num_target_layers=num_target_layers,
        target_layer_ids=_target_layer_ids(draft, shape["num_hidden_layers"], num_target_layers, check),
        mask_token=mask_token,
        mask_token_id=_mask_token_id(draft, mask_token, target_config.vocab_size, tokenizer, check),
        layer_types=layer_types, sliding_window=window)


class _Checker:
    """Raises ConfigErrors that name the file, the key, the value and what is allowed."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{self.source}: {key!r} = {value!r} is not valid; allowed: {allowed}")

    def int_at_least(self, value: Any, key: str, minimum: int) -> int:
        if value is None:
            raise ConfigError(f"{self.source}: required key {key!r} is missing; allowed: an integer >= {minimum}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, value, f"an integer >= {minimum}")
        return value


def _lookup(raw: Mapping[str, Any], draft: Mapping[str, Any], key: str) -> Any:
    """A key at the top level, else inside ``dflash_config`` (some exports put it there)."""
    return raw[key] if key in raw else draft.get(key)


def _dflash_section(raw: Mapping[str, Any], check: _Checker) -> Mapping[str, Any]:
    draft = raw.get("dflash_config")
    architectures = raw.get("architectures") or []
    if draft is None and DRAFTER_ARCHITECTURE not in architectures:
        raise ConfigError(
            f"{check.source}: not a DFlash drafter config: 'architectures' = {architectures!r} and there is no "
            f"'dflash_config'; allowed: a z-lab DFlash checkpoint (architectures [{DRAFTER_ARCHITECTURE!r}] "
            f"with a dflash_config section)")
    if draft is None:
        return {}
    if not isinstance(draft, Mapping):
        check.fail("dflash_config", draft, "an object with mask_token_id, target_layer_ids, mask_token")
    return draft


def _layer_shape(raw: Mapping[str, Any], check: _Checker) -> dict[str, int]:
    hidden = check.int_at_least(raw.get("hidden_size"), "hidden_size", 1)
    heads = check.int_at_least(raw.get("num_attention_heads"), "num_attention_heads", 1)
    kv_heads = check.int_at_least(raw.get("num_key_value_heads") or heads, "num_key_value_heads", 1)
    if heads % kv_heads:
        check.fail("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
    head_dim = check.int_at_least(raw.get("head_dim") or hidden // heads, "head_dim", 2)
    if head_dim % 2:
        check.fail("head_dim", head_dim, "an even integer (RoPE rotates pairs)")
    return dict(
        hidden_size=hidden,
        intermediate_size=check.int_at_least(raw.get("intermediate_size"), "intermediate_size", 1),
        num_hidden_layers=check.int_at_least(raw.get("num_hidden_layers"), "num_hidden_layers", 1),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)


def _check_pair(raw: Mapping[str, Any], draft: Mapping[str, Any], hidden: int, target: ModelConfig,
                check: _Checker) -> None:
    """Refuse a drafter made for another target, naming every number that disagrees."""
    layers = _lookup(raw, draft, "num_target_layers")
    if layers is None:
        layers = target.num_hidden_layers  # older exports omit it; the target decides
    check.int_at_least(layers, "num_target_layers", 1)
    disagree = []
    if hidden != target.hidden_size:
        disagree.append(f"'hidden_size' = {hidden} but the target's hidden size is {target.hidden_size}")
    if layers != target.num_hidden_layers:
        disagree.append(f"'num_target_layers' = {layers} but the target has {target.num_hidden_layers} layers")
    if disagree:
        raise ConfigError(
            f"{check.source}: this drafter was made for another target: {'; '.join(disagree)}; "
            f"allowed: a drafter whose hidden_size and num_target_layers equal the target's")


def _rope(raw: Mapping[str, Any], check: _Checker) -> tuple[float, RopeScaling]:
    try:
        return rope_settings(raw)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{check.source}: 'rope_parameters' / 'rope_theta': {err}") from None


def _eps(raw: Mapping[str, Any], check: _Checker) -> float:
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        check.fail("rms_norm_eps", eps, "a positive number")
    return float(eps)


def _block_size(checkpoint_block: int, override: int | None, check: _Checker) -> int:
    if override is None:
        return checkpoint_block
    if isinstance(override, bool) or not isinstance(override, int) or not 2 <= override <= checkpoint_block:
        raise ConfigError(
            f"{check.source}: block size override {override!r} is not valid for 'block_size' = {checkpoint_block}; "
            f"allowed: an integer in [2, {checkpoint_block}] (a block size may only be lowered)")
    return override


def _target_layer_ids(draft: Mapping[str, Any], num_draft_layers: int, num_target_layers: int,
                      check: _Checker) -> tuple[int, ...]:
    key = "dflash_config.target_layer_ids"
    allowed = f"a non-empty list of integers in [0, {num_target_layers}) (the target's layers)"
    ids = draft.get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(num_target_layers, num_draft_layers)
        allowed += (f"; the key is absent, so the ids were spread over num_target_layers = {num_target_layers} "
                    f"for num_hidden_layers = {num_draft_layers}: record target_layer_ids in the checkpoint")
    if not isinstance(ids, (list, tuple)) or not ids:
        check.fail(key, ids, allowed)
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_target_layers:
            check.fail(key, list(ids), allowed)
    return tuple(ids)


def _layer_types(raw: Mapping[str, Any], num_layers: int, check: _Checker) -> tuple[tuple[str, ...], int | None]:
    types = raw.get("layer_types")
    if types is None:
        return (FULL_ATTENTION,) * num_layers, None
    if (not isinstance(types, (list, tuple)) or len(types) != num_layers
            or any(t not in LAYER_TYPES for t in types)):
        check.fail("layer_types", types, f"a list of {num_layers} entries (num_hidden_layers), each one of "
                                         f"{', '.join(LAYER_TYPES)}")
    if SLIDING_ATTENTION not in types:
        return tuple(types), None
    window = raw.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        check.fail("sliding_window", window, "an integer >= 1 (layer_types has sliding_attention layers)")
    return tuple(types), window


def _mask_token_id(draft: Mapping[str, Any], mask_token: str, vocab: int, tokenizer, check: _Checker) -> int:
    """The recorded id (checked against the tokenizer), else the tokenizer's id for the mask
    token, adding the token when the tokenizer lacks it."""
    recorded = draft.get("mask_token_id")
    known = _tokenizer_id(tokenizer, mask_token)
    if recorded is not None:
        if isinstance(recorded, bool) or not isinstance(recorded, int) or not 0 <= recorded < vocab:
            check.fail("dflash_config.mask_token_id", recorded,
                       f"an integer in [0, {vocab}) (the target's vocabulary size is {vocab})")
        if known is not None and known != recorded:
            check.fail("dflash_config.mask_token_id", recorded,
                       f"{known}, the id the target's tokenizer gives the mask token {mask_token!r}")
        return recorded
    if known is not None:
        if known >= vocab:
            check.fail("dflash_config.mask_token", mask_token,
                       f"a token whose id is below the target's vocabulary size {vocab} (the tokenizer gives "
                       f"it id {known}, and the target has no embedding row for it)")
        return known
    if tokenizer is None:
        raise ConfigError(
            f"{check.source}: 'dflash_config.mask_token_id' is missing and there is no tokenizer to look up "
            f"'dflash_config.mask_token' = {mask_token!r}; allowed: record mask_token_id (an integer in "
            f"[0, {vocab})) in the checkpoint, or load a target with a tokenizer")
    return _add_mask_token(tokenizer, mask_token, vocab, check)


def _tokenizer_id(tokenizer, token: str) -> int | None:
    if tokenizer is None:
        return None
    found = tokenizer.get_vocab().get(token)
    return None if found is None else int(found)


def _add_mask_token(tokenizer, mask_token: str, vocab: int, check: _Checker) -> int:
    new_id = len(tokenizer)  # the id the tokenizer will give the new token
    if new_id >= vocab:
        raise ConfigError(
            f"{check.source}: 'dflash_config.mask_token_id' is missing and the tokenizer lacks "
            f"'dflash_config.mask_token' = {mask_token!r}; adding it would give id {new_id}, but the target has no "
            f"embedding row for it (vocabulary size {vocab}); allowed: a checkpoint that records mask_token_id "
            f"(an integer in [0, {vocab}))")
    params = inspect.signature(tokenizer.add_special_tokens).parameters
    keep = {name: False for name in ("replace_extra_special_tokens", "replace_additional_special_tokens")
            if name in params}  # transformers 5 / 4 spelling: keep the tokenizer's other specials
    tokenizer.add_special_tokens({"additional_special_tokens": [mask_token]}, **keep)
    added = _tokenizer_id(tokenizer, mask_token)
    if added is None or added >= vocab:
        raise ConfigError(
            f"{check.source}: adding 'dflash_config.mask_token' = {mask_token!r} to the tokenizer gave id {added}, "
            f"but the target has no embedding row for it (vocabulary size {vocab}); allowed: a checkpoint that "
            f"records mask_token_id (an integer in [0, {vocab}))")
    return added
