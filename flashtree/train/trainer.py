"""``flashtree train-drafter``: the training loop.

One step: a batch of sequences -> anchors and blocks (CPU, seeded) -> the frozen target's
context features (no grad) -> the drafter's training forward over all blocks at once -> the
decayed cross-entropy -> AdamW with clipping, under a warmup + cosine schedule. Held-out
metrics (loss, per-slot accuracy, tau estimate) every ``eval_every`` steps and at the end;
the checkpoint (z-lab format + ``trainer_state/`` + the curve PNG) every ``save_every`` steps and
at the end, also when a time or step limit of this run stops it early.

Resuming is exact: the saved state holds the float32 weights, the optimizer, the data position
and every RNG the loop draws from, so N steps, a stop, and N more steps with ``--resume`` give the
weights one run of 2N steps gives (bit for bit on the CPU in float32), as long as the schedule is
set by steps (``--time-budget-s`` makes the learning rate follow the wall clock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable

import torch

from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.train import checkpoint, trainer_state
from flashtree.train.anchors import AnchorBlocks, make_blocks
from flashtree.train.batching import TokenBatch, collate
from flashtree.train.config import TrainConfig
from flashtree.train.curve import write_curve
from flashtree.train.deadline import Deadline
from flashtree.train.dflash2_loss import dflash2_block_loss
from flashtree.train.forward import training_hidden
from flashtree.train.loss import BlockLoss, MetricTotals, block_loss
from flashtree.train.setup import TrainSetup, prepare

EVAL_SEED_OFFSET = 7919  # held-out anchors use their own fixed generator


@dataclasses.dataclass(frozen=True)
class TrainResult:
    output: str
    steps: int
    seconds: float
    stopped_by: str  # "steps" | "time" (budget spent) | "stop_after" | "stop_after_steps" | "max_minutes" (resumable)
    train: dict  # metrics of the last log window
    heldout: dict  # final held-out metrics (empty without held-out data)
    weights_mb: float
    history: list

    def summary(self) -> dict:
        return {"output": self.output, "steps": self.steps, "seconds": round(self.seconds, 1),
                "stopped_by": self.stopped_by, "weights_mb": round(self.weights_mb, 2),
                "train": self.train, "heldout": self.heldout}


def lr_at(cfg: TrainConfig, step: int, total_steps: int, time_fraction: float = 0.0) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to ``min_lr_ratio * lr``; the cosine
    follows the further of step progress and (with a time budget) elapsed-time progress."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, total_steps - cfg.warmup)
    progress = min(1.0, max((step - cfg.warmup) / span, time_fraction))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _autocast(setup: TrainSetup):
    dtype = setup.autocast_dtype
    return torch.autocast(setup.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _attention(setup: TrainSetup) -> str:
    if setup.cfg.attention != "auto":
        return setup.cfg.attention
    return "flex" if setup.device.type == "cuda" else "dense"


def batch_loss(setup: TrainSetup, batch: TokenBatch, generator: torch.Generator) -> BlockLoss:
    """The loss of one batch (grad flows into the drafter only)."""
    cfg = setup.cfg
    blocks = make_blocks(batch.input_ids, batch.assistant_mask, cfg.anchors_per_seq,
                         setup.drafter.config.block_size, setup.mask_token_id, generator)
    blocks = AnchorBlocks(*(t.to(setup.device, non_blocking=True) for t in blocks))
    ids, lengths = batch.input_ids.to(setup.device), batch.lengths.to(setup.device)
    features = setup.features(ids, lengths)  # [B, N, C], no grad
    with _autocast(setup):
        hidden = training_hidden(setup.drafter, features, blocks, _attention(setup))  # [B, A, b-1, hidden]
        gamma = cfg.gamma(setup.drafter.config.block_size)
        if isinstance(setup.drafter, DFlash2Drafter):
            return dflash2_block_loss(setup.drafter, hidden, blocks, gamma, cfg.selector_loss_weight)
        return block_loss(hidden, setup.drafter.target.head, blocks.labels, blocks.label_mask, gamma)


def train_step(setup: TrainSetup, batch: TokenBatch, generator: torch.Generator, lr: float) -> BlockLoss:
    for group in setup.optimizer.param_groups:
        group["lr"] = lr
    result = batch_loss(setup, batch, generator)
    result.loss.backward()
    torch.nn.utils.clip_grad_norm_(setup.drafter.parameters(), setup.cfg.grad_clip)
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return result


def eval_batches(setup: TrainSetup) -> list[TokenBatch]:
    """A fixed set of held-out batches (same every eval, so the numbers are comparable)."""
    cfg = setup.cfg
    per_batch = cfg.batch_size or max(1, cfg.batch_tokens // cfg.max_seq_len)
    samples = setup.heldout_samples[:per_batch * cfg.eval_batches]
    return [collate(samples[i:i + per_batch]) for i in range(0, len(samples), per_batch)]


@torch.no_grad()
def evaluate(setup: TrainSetup, batches: Iterable[TokenBatch]) -> dict:
    """Held-out loss, per-slot accuracy and tau estimate (empty dict without batches)."""
    setup.drafter.eval()
    totals = MetricTotals()
    generator = torch.Generator().manual_seed(setup.cfg.seed + EVAL_SEED_OFFSET)
    for batch in batches:
        totals.add(batch_loss(setup, batch, generator))
    setup.drafter.train()
    return totals.summary() if totals.batches else {}


def save(setup: TrainSetup, step: int, elapsed: float) -> float:
    """Write the checkpoint, the trainer state, the metrics and the curve; returns the weights' MB."""
    cfg = setup.cfg
    raw = dict(setup.raw_config, dtype=cfg.save_dtype)
    tensors = checkpoint.drafter_tensors(setup.drafter, getattr(torch, cfg.save_dtype))
    checkpoint.save_drafter(cfg.output, raw, tensors, cfg.max_shard_mb)
    epoch, batch = setup.stream.position
    trainer_state.save(cfg.output, trainer_state.TrainerState(
        step=step, elapsed_s=elapsed,
        data_position={"epoch": epoch, "batch": batch, "fingerprint": setup.data_fingerprint},
        history=setup.history, train_config=cfg.to_dict(),
        model=checkpoint.drafter_tensors(setup.drafter, torch.float32),
        optimizer=setup.optimizer.state_dict(), rng=trainer_state.capture_rng(setup.anchors)))
    checkpoint.remove_legacy_state(cfg.output)
    checkpoint.save_metrics(cfg.output, {"step": step, "history": setup.history})
    write_curve(cfg.output, setup.history, f"{cfg.output}: step {step}")
    return checkpoint.weights_bytes(cfg.output) / 2**20


def _progress(setup: TrainSetup):
    from tqdm import tqdm

    return tqdm(total=setup.total_steps, initial=setup.start_step, desc="train-drafter", unit="step",
                disable=not setup.cfg.progress, dynamic_ncols=True)


def _log(bar, text: str) -> None:
    if bar.disable:
        print(text, flush=True)
    else:
        bar.write(text)


class _Window:
    """Metrics and throughput since the last log line."""

    def __init__(self) -> None:
        self.totals = MetricTotals()
        self.tokens = 0
        self.seconds = 0.0

    def add(self, result: BlockLoss, tokens: int, seconds: float) -> None:
        self.totals.add(result)
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def record(self, step: int, seconds: float) -> dict:
        return {"step": step, "seconds": round(seconds, 1), "split": "train", **self.totals.summary(),
                "tokens_per_s": round(self.tokens_per_s, 1)}


def _stop_reason(setup: TrainSetup, step: int, elapsed: float, this_run: float, steps_this_run: int,
                 deadline: Deadline | None) -> str | None:
    cfg = setup.cfg
    if step >= setup.total_steps:
        return "steps"
    if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
        return "time"
    if cfg.stop_after_s is not None and this_run >= cfg.stop_after_s:
        return "stop_after"
    if cfg.stop_after_steps is not None and steps_this_run >= cfg.stop_after_steps:
        return "stop_after_steps"
    if deadline is not None and deadline.should_stop():
        return "max_minutes"
    return None


def run(setup: TrainSetup, started_at: float | None = None) -> TrainResult:
    """Train from ``setup.start_step`` to ``setup.total_steps`` or a limit of this run.

    ``started_at``: the ``time.perf_counter()`` reading ``--max-minutes`` counts from (default: now)."""
    cfg = setup.cfg
    held = eval_batches(setup)
    if not held:
        print(f"warning: no held-out conversations in --data {cfg.data} (heldout_percent={cfg.heldout_percent}); "
              f"no held-out metrics. Data regenerated from the train split alone has none: regenerate prompts "
              f"of both splits (export-prompts --sources ..., or --split all)", flush=True)
    position = None
    if setup.resumed_state is not None:
        saved = setup.resumed_state.data_position
        position = (int(saved["epoch"]), int(saved["batch"]))
    batches = setup.stream.iterate(setup.start_step, position)
    start = time.perf_counter()
    deadline = Deadline(cfg.max_minutes * 60, started_at or start, len(held)) \
        if cfg.max_minutes is not None else None
    prior = setup.resumed_state.elapsed_s if setup.resumed_state is not None else 0.0
    bar = _progress(setup)
    window = _Window()
    train_metrics: dict = {}
    step = setup.start_step
    setup.drafter.train()
    while True:
        this_run = time.perf_counter() - start
        elapsed = prior + this_run  # the schedule follows the whole training, resumes included
        stopped_by = _stop_reason(setup, step, elapsed, this_run, step - setup.start_step, deadline)
        if stopped_by is not None:
            break
        fraction = elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0
        batch = next(batches)
        began = time.perf_counter()
        result = train_step(setup, batch, setup.anchors, lr_at(cfg, step, setup.total_steps, fraction))
        took = time.perf_counter() - began
        window.add(result, int(batch.lengths.sum()), took)
        if deadline is not None:
            deadline.step_took(took)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{window.totals.loss:.3f}", tau=f"{window.totals.tau:.2f}",
                        tok_s=f"{window.tokens_per_s:.0f}", refresh=False)
        if step % cfg.log_every == 0 or step == setup.total_steps:
            record = window.record(step, prior + time.perf_counter() - start)
            setup.history.append(record)
            train_metrics = window.totals.summary()
            if bar.disable:  # no bar: a log line instead
                print(f"step {step}/{setup.total_steps} {time.perf_counter() - start:.0f}s loss {record['loss']:.4f} "
                      f"acc1 {record['acc1']:.3f} tau {record['tau']:.2f} {record['tokens_per_s']:.0f} tok/s", flush=True)
            window = _Window()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < setup.total_steps and held:
            began = time.perf_counter()
            metrics = evaluate(setup, held)
            if deadline is not None:
                deadline.eval_took(time.perf_counter() - began)
            setup.history.append({"step": step, "seconds": round(prior + time.perf_counter() - start, 1),
                                  "split": "heldout", **metrics})
            _log(bar, f"step {step}: held-out loss {metrics['loss']:.4f} acc1 {metrics['acc1']:.3f} "
                      f"tau {metrics['tau']:.2f}")
        if cfg.save_every and step % cfg.save_every == 0:
            began = time.perf_counter()
            save(setup, step, prior + time.perf_counter() - start)
            if deadline is not None:
                deadline.save_took(time.perf_counter() - began)
    bar.close()
    if not train_metrics and window.totals.batches:
        train_metrics = window.totals.summary()
    heldout = evaluate(setup, held) if held else {}
    seconds = time.perf_counter() - start
    if heldout:
        setup.history.append({"step": step, "seconds": round(prior + seconds, 1), "split": "heldout", **heldout})
    weights_mb = save(setup, step, prior + seconds)
    return TrainResult(cfg.output, step, seconds, stopped_by, train_metrics, heldout, weights_mb, setup.history)


def train(cfg: TrainConfig, started_at: float | None = None) -> TrainResult:
    """Prepare everything (target, data, drafter, optimizer, resume) and train."""
    started_at = time.perf_counter() if started_at is None else started_at
    return run(prepare(cfg), started_at)
