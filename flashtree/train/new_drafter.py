"""A fresh drafter for a target: its z-lab ``config.json`` dict, its mask token, its modules.

Defaults: drafter hidden size = the target's (the format requires it); heads, kv heads, head dim,
intermediate size (unless given: the width lever), rms eps and RoPE copied from the target; ``target_layer_ids`` spread over the
target's layers with the format's own rule; every layer full attention.

Mask token: the tokenizer's ``<|MASK|>`` when it has one inside the target's vocabulary; else
a special token that never occurs in chat (``<issue_start>``, id 8 in SmolLM2, whose 49,152
embedding rows are all real tokens); else another added special token the
chat template does not use; else a spare embedding row past the tokenizer (recorded as
``<|MASK|>``). The choice is written to ``dflash_config`` so the checkpoint is self-describing.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from flashtree.errors import ConfigError
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashDrafter, build_drafter
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.models.dflash2_config import parse_dflash2_config
from flashtree.models.dflash_config import (
    DEFAULT_MASK_TOKEN,
    DFLASH2_ARCHITECTURE,
    DRAFTER_ARCHITECTURE,
    FULL_ATTENTION,
    default_target_layer_ids,
    is_dflash2,
    parse_dflash_config,
)
from flashtree.models.transformer import CausalLM

UNUSED_SPECIAL_TOKENS = ("<issue_start>",)  # never in chat: SmolLM2's code-metadata specials
# a new DFlash2 drafter's own numbers: the published checkpoints' (2 taps, groups of 16 channels, codebooks
# of rank 256, 16 candidates per slot); no output multiplier or soft cap (the targets flashtree runs have none)
DFLASH2_TAPS, DFLASH2_GROUP, DFLASH2_RANK, DFLASH2_TOP_K = 2, 16, 256, 16


class MaskToken(NamedTuple):
    token_id: int
    token: str


def choose_mask_token(tokenizer, vocab_size: int, requested: int | None = None) -> MaskToken:
    """The mask token for a target (see the module docstring for the order of preference)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise ConfigError(f"--mask-token-id {requested} is outside the target's vocabulary [0, {vocab_size})")
        names = {i: t for t, i in vocab.items() if i == requested}
        return MaskToken(requested, names.get(requested, DEFAULT_MASK_TOKEN))
    for name in (DEFAULT_MASK_TOKEN, *UNUSED_SPECIAL_TOKENS):
        if name in vocab and vocab[name] < vocab_size:
            return MaskToken(int(vocab[name]), name)
    spare = _unused_special(tokenizer, vocab_size)
    if spare is not None:
        return spare
    if tokenizer is not None and len(tokenizer) < vocab_size:
        return MaskToken(len(tokenizer), DEFAULT_MASK_TOKEN)  # an embedding row no token uses
    raise ConfigError(f"the target's tokenizer has no {DEFAULT_MASK_TOKEN} token, no unused special token and no "
                      f"spare embedding row (vocabulary {vocab_size}); pass --mask-token-id ID")


def _unused_special(tokenizer, vocab_size: int) -> MaskToken | None:
    """An added special token that is not bos/eos/pad/unk and not produced by the chat template."""
    if tokenizer is None:
        return None
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    if getattr(tokenizer, "chat_template", None):
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}]
        try:
            used.update(tokenizer.apply_chat_template(probe, tokenize=True, return_dict=True)["input_ids"])
        except Exception:  # a template that refuses the probe: be conservative, pick nothing
            return None
    candidates = [(i, t) for t, i in tokenizer.get_vocab().items()
                  if t in set(tokenizer.all_special_tokens) and i not in used and i < vocab_size]
    return MaskToken(*max(candidates)) if candidates else None


def spread_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The format's default spread, kept inside ``[0, L)`` and without repeats (tiny targets)."""
    spread = default_target_layer_ids(num_target_layers, num_draft_layers)
    clamped = (min(max(i, 0), num_target_layers - 1) for i in spread)
    return tuple(dict.fromkeys(clamped))


def drafter_config_dict(target: ModelConfig, layers: int, block_size: int, mask: MaskToken,
                        target_layer_ids: tuple[int, ...] | None = None, dtype: str = "bfloat16",
                        intermediate_size: int | None = None, arch: str = "dflash",
                        selector_rank: int | None = None) -> dict[str, Any]:
    """The z-lab ``config.json`` of a new drafter for ``target`` (MLP width ``intermediate_size``,
    the target's when None; the hidden size is always the target's: the format requires it);
    ``arch`` "dflash2": a DFlash2 drafter (:func:`dflash2_keys`, with ``selector_rank``)."""
    ids = target_layer_ids or spread_layer_ids(target.num_hidden_layers, layers)
    raw: dict[str, Any] = {
        "architectures": [DRAFTER_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size, "num_hidden_layers": layers, "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        "max_position_embeddings": target.max_position_embeddings, "attention_bias": False,
        "tie_word_embeddings": False, "layer_types": [FULL_ATTENTION] * layers,
        "dflash_config": {"mask_token_id": mask.token_id, "target_layer_ids": list(ids), "mask_token": mask.token},
        "dtype": dtype,
    }
    scaling = target.rope_scaling
    if scaling.rope_type != "default":
        raw["rope_scaling"] = {"rope_type": scaling.rope_type, "factor": scaling.factor,
                               "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                               "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return as_dflash2_config(raw, target, selector_rank) if arch == "dflash2" else raw


def as_dflash2_config(raw: dict[str, Any], target: ModelConfig, selector_rank: int | None = None) -> dict[str, Any]:
    """A first-generation drafter's ``config.json`` dict made a DFlash2 drafter's: the same shape, mask token
    and target layers, the block size moved into ``dflash_config``, and :func:`dflash2_keys`. A new dict."""
    draft = dict(raw["dflash_config"])
    upgraded = {key: value for key, value in raw.items() if key != "block_size"}
    draft.update(block_size=raw.get("block_size", draft.get("block_size")), **dflash2_keys(target, selector_rank))
    upgraded.update(architectures=[DFLASH2_ARCHITECTURE], is_causal=False, hidden_act="silu", dflash_config=draft)
    return upgraded


def dflash2_keys(target: ModelConfig, selector_rank: int | None = None) -> dict[str, int]:
    """A new DFlash2 drafter's ``dflash_config`` keys (models/dflash2_config.py) for ``target``: the
    published numbers (``selector_rank`` where given), the group a divisor of the hidden size, at most a
    vocabulary of candidates."""
    return {"conv_kernel_size": DFLASH2_TAPS, "conv_group_size": math.gcd(target.hidden_size, DFLASH2_GROUP),
            "selector_rank": selector_rank or DFLASH2_RANK, "selector_top_k": min(DFLASH2_TOP_K, target.vocab_size)}


def trainable_drafter(raw: dict[str, Any], target: CausalLM, tokenizer, device: torch.device,
                      weights: dict[str, torch.Tensor] | None = None, seed: int = 0,
                      source: str = "new drafter config.json") -> DFlashDrafter:
    """Build the inference :class:`DFlashDrafter` (a :class:`DFlash2Drafter` for a DFlash2 config)
    from ``raw`` (validated like a loaded checkpoint) in float32 master weights, unfused, with grads
    on: training uses its modules as they are. ``weights`` None: a new drafter (random weights; a
    DFlash2 drafter's additions start as no-ops, :func:`start_dflash2_as_dflash`)."""
    if is_dflash2(raw):
        config = parse_dflash2_config(raw, source, target.config, tokenizer)
        drafter = build_drafter(config, target, weights, device, torch.float32, seed=seed, drafter_class=DFlash2Drafter)
        if weights is None:
            start_dflash2_as_dflash(drafter, seed)
    else:
        config = parse_dflash_config(raw, source, target.config, tokenizer)
        drafter = build_drafter(config, target, weights, device, torch.float32, seed=seed)
    unfuse(drafter)
    drafter.requires_grad_(True).train()
    return drafter


@torch.no_grad()
def start_dflash2_as_dflash(drafter: DFlash2Drafter, seed: int) -> None:
    """A new DFlash2 drafter's convolutions pass their input through (tap 0's base 1, the other
    taps and the input-dependent part 0) and its selector adds nothing (hidden projection 0), so it
    starts as a first-generation drafter; the codebooks get unit-variance rows of ``A * B`` so that
    the selector learns as soon as its projection moves."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    selector = drafter.candidate_selector
    selector.hidden_projection.weight.zero_()
    gen = torch.Generator(device=selector.predecessor_codebook.device).manual_seed(seed)
    rank = selector.predecessor_codebook.shape[1]
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.normal_(0.0, rank ** -0.25, generator=gen)


def dflash2_from_dflash(raw: dict[str, Any], weights: dict[str, torch.Tensor], target: CausalLM, tokenizer,
                        seed: int = 0, source: str = "--init config.json", selector_rank: int | None = None
                        ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, weights) of a DFlash2 drafter that starts as the first-generation drafter (``raw``,
    ``weights``): its weights as they are, with the DFlash2 additions (float32) as a new drafter's no-ops
    (:func:`start_dflash2_as_dflash`), so it drafts as that drafter did until training moves them."""
    upgraded = as_dflash2_config(raw, target.config, selector_rank)
    fresh = trainable_drafter(upgraded, target, tokenizer, torch.device("cpu"), seed=seed, source=source)
    added = {name: p.detach() for name, p in fresh.named_parameters() if name not in weights}
    return upgraded, weights | added


def unfuse(drafter: DFlashDrafter) -> None:
    """Drop inference-time fused projections (plain tensors that autograd would not train)."""
    for layer in drafter.layers:
        for module, names in ((layer.self_attn, ("qkv_weight", "qkv_bias")), (layer.mlp, ("gate_up",))):
            for name in names:
                if getattr(module, name, None) is not None:
                    setattr(module, name, None)
