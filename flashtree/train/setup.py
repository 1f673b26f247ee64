"""Everything a training run holds before its first step: the frozen target, the data, the
drafter (new, or resumed from a checkpoint directory), the optimizer and where to start."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from flashtree.errors import ConfigError
from flashtree.models.build import build_model, resolve_device, resolve_dtype
from flashtree.models.dflash import DFlashDrafter
from flashtree.models.dflash_config import is_dflash2
from flashtree.models.loader import load_checkpoint
from flashtree.models.tokenizer import stop_token_ids_for
from flashtree.models.transformer import CausalLM
from flashtree.train import checkpoint, trainer_state
from flashtree.train.batching import BatchStream
from flashtree.train.config import TrainConfig
from flashtree.train.data import load_conversations, split_conversations
from flashtree.train.encode import EncodedConversation, encode_all
from flashtree.train.new_drafter import (
    choose_mask_token,
    dflash2_from_dflash,
    drafter_config_dict,
    trainable_drafter,
)
from flashtree.train.target_features import TargetFeatures
from flashtree.train.trainer_state import TrainerState

ANCHOR_SEED_FACTOR = 7  # the anchor sampler's generator starts at seed * 7 (kept from the first recipe)
# TrainConfig fields a resumed run may change without leaving the interrupted run's path
PER_RUN_FIELDS = frozenset({"output", "resume", "init", "steps", "epochs", "time_budget_s", "stop_after_s",
                            "stop_after_steps", "max_minutes", "eval_every", "eval_batches", "save_every",
                            "save_dtype", "max_shard_mb", "log_every", "progress", "device"})


@dataclasses.dataclass
class TrainSetup:
    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype  # target dtype; also the autocast dtype when lower than float32
    target: CausalLM
    tokenizer: Any
    features: TargetFeatures
    drafter: DFlashDrafter
    raw_config: dict[str, Any]  # the drafter's config.json
    train_samples: list[EncodedConversation]
    heldout_samples: list[EncodedConversation]
    stream: BatchStream
    optimizer: torch.optim.Optimizer
    start_step: int
    total_steps: int
    history: list[dict]
    resumed_state: TrainerState | None
    anchors: torch.Generator  # the anchor sampler's generator (its state is saved and restored)
    data_fingerprint: str

    @property
    def mask_token_id(self) -> int:
        return self.drafter.config.mask_token_id

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.dtype if self.dtype != torch.float32 else None


def load_target(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, Any]:
    ckpt = load_checkpoint(cfg.model)
    if ckpt.tokenizer is None:
        raise ConfigError(f"--model {cfg.model}: has no tokenizer; training needs its chat template")
    return build_model(ckpt.config, ckpt.weights, device, dtype, seed=cfg.seed), ckpt.tokenizer


def load_samples(cfg: TrainConfig, target: CausalLM, tokenizer) -> tuple[list, list]:
    """(train, held-out) encoded conversations; the split is by conversation."""
    convs = load_conversations(cfg.data)
    if cfg.max_conversations is not None:
        convs = convs[:cfg.max_conversations]
    train, heldout = split_conversations(convs, cfg.heldout_percent)
    end_of_turn = frozenset(stop_token_ids_for(target.config, tokenizer))
    return tuple(encode_all(tokenizer, items, cfg.max_seq_len, end_of_turn, progress=cfg.progress)
                 for items in (train, heldout))


def drafter_source(cfg: TrainConfig, target: CausalLM, tokenizer
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None, TrainerState | None]:
    """(config.json dict, float32 start weights or None for random, trainer state or None)."""
    source = cfg.resume or cfg.init
    if source is None:
        mask = choose_mask_token(tokenizer, target.config.vocab_size, cfg.mask_token_id)
        return drafter_config_dict(target.config, cfg.layers, cfg.block_size, mask, cfg.target_layer_ids,
                                   cfg.save_dtype, cfg.intermediate_size, cfg.arch, cfg.selector_rank), None, None
    raw, weights = checkpoint.read_drafter(source)
    kept_rank = raw.get("dflash_config", {}).get("selector_rank") if is_dflash2(raw) else None
    if cfg.selector_rank is not None and kept_rank is not None and kept_rank != cfg.selector_rank:
        raise ConfigError(f"--selector-rank {cfg.selector_rank}: {source} is a DFlash2 drafter with selector_rank "
                          f"{kept_rank}, which it keeps; leave --selector-rank out or give {kept_rank}")
    state = trainer_state.load(source) if cfg.resume is not None else None
    if cfg.resume is not None and state is None:
        print(f"note: {source} has no {trainer_state.STATE_DIR}/: a new run starts from its weights "
              f"(new optimizer, schedule and data position)", flush=True)
    if state is not None:
        weights = state.model
    elif cfg.arch == "dflash2" and not is_dflash2(raw):  # a new run: --arch dflash2 upgrades a first generation
        raw, weights = dflash2_from_dflash(raw, weights, target, tokenizer, cfg.seed, f"{source}/config.json",
                                           cfg.selector_rank)
    return raw, {k: v.float() for k, v in weights.items()}, state


def check_resumable(cfg: TrainConfig, state: TrainerState, fingerprint: str, source: str) -> None:
    """The resumed run must read the same data; changed settings are named (they leave the
    interrupted run's path, so the result is no longer what one uninterrupted run gives)."""
    saved = state.data_position.get("fingerprint")
    if saved != fingerprint:
        raise ConfigError(f"--resume {source}: --data {cfg.data} (with --max-seq-len, --batch-size/--batch-tokens, "
                          f"--seed, --heldout-percent, --max-conversations) is not the data of the run being resumed "
                          f"(fingerprint {fingerprint[:12]} vs {str(saved)[:12]}): its saved position would be "
                          f"meaningless; pass the same data, or start a new run from these weights with --init")
    now = cfg.to_dict()
    changed = sorted(k for k, v in state.train_config.items()
                     if k not in PER_RUN_FIELDS and k in now and _jsonish(now[k]) != _jsonish(v))
    if changed:
        print(f"warning: resuming with changed settings ({', '.join(f'{k}: {state.train_config[k]!r} -> {now[k]!r}' for k in changed)}); "
              f"the run leaves the path of the interrupted one", flush=True)


def _jsonish(value):
    return list(value) if isinstance(value, tuple) else value


def make_optimizer(cfg: TrainConfig, drafter: DFlashDrafter) -> torch.optim.Optimizer:
    decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(drafter.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def prepare(cfg: TrainConfig) -> TrainSetup:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_target(cfg, device, dtype)
    raw, weights, state = drafter_source(cfg, target, tokenizer)
    drafter = trainable_drafter(raw, target, tokenizer, device, weights, seed=cfg.seed,
                                source=f"{cfg.resume or cfg.init or 'new drafter'}/config.json")
    if weights is None:
        with torch.no_grad():
            drafter.norm.weight.fill_(cfg.output_norm_init)
    drafter.setup_rope(cfg.max_seq_len + drafter.config.block_size + 1)
    train_samples, heldout_samples = load_samples(cfg, target, tokenizer)
    if not train_samples:
        raise ConfigError(f"--data {cfg.data}: no training conversation has assistant tokens to learn from")
    stream = BatchStream(train_samples, cfg.seed, cfg.batch_size if cfg.batch_tokens is None else None,
                         cfg.batch_tokens)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * stream.batches_per_epoch()))
    optimizer = make_optimizer(cfg, drafter)
    anchors = torch.Generator().manual_seed(cfg.seed * ANCHOR_SEED_FACTOR)
    fingerprint = stream.fingerprint()
    start_step, history = 0, []
    if state is not None:
        check_resumable(cfg, state, fingerprint, cfg.resume)
        optimizer.load_state_dict(state.optimizer)
        trainer_state.restore_rng(state.rng, anchors)
        start_step, history = state.step, list(state.history)
    features = TargetFeatures(target, drafter.config.target_layer_ids)
    return TrainSetup(cfg, device, dtype, target, tokenizer, features, drafter, raw, train_samples,
                      heldout_samples, stream, optimizer, start_step, max(total, start_step), history, state,
                      anchors, fingerprint)
