"""TrainConfig: everything that shapes a drafter training run, validated once, frozen."""

from __future__ import annotations

import dataclasses
import math

from flashtree.errors import ConfigError

# Loss decay per block size (DFlash): slot k (1-based) weighs exp(-(k - 1) / gamma).
GAMMA_BY_BLOCK = {8: 4.0, 10: 5.0, 16: 7.0}
ATTENTION_KINDS = ("auto", "flex", "dense")
SAVE_DTYPES = ("bfloat16", "float16", "float32")
ARCHES = ("dflash", "dflash2")  # a new drafter's format: DFlashDraftModel or DFlash2DraftModel (models/dflash2.py)


def loss_gamma(block_size: int, override: float | None = None) -> float:
    """gamma for a block size: 4 / 5 / 7 for blocks 8 / 10 / 16, piecewise linear in between,
    the nearest segment extended beyond (never below 1). ``override``: that gamma instead, and
    0 for no decay (every slot weighs 1)."""
    if override is not None:
        return math.inf if override == 0 else float(override)
    points = sorted(GAMMA_BY_BLOCK.items())
    (x0, y0), (x1, y1) = points[0], points[1]
    for (lo, g_lo), (hi, g_hi) in zip(points, points[1:]):
        if block_size >= lo:
            (x0, y0), (x1, y1) = (lo, g_lo), (hi, g_hi)
    return max(1.0, y0 + (y1 - y0) * (block_size - x0) / (x1 - x0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "smollm2"  # target: anything --model accepts
    data: str = "sharegpt"  # sharegpt | path.jsonl | path.json
    output: str = "drafter"  # checkpoint directory
    resume: str | None = None  # checkpoint directory with trainer_state/ (continue that run exactly)
    init: str | None = None  # drafter checkpoint to start a new run from (its weights and shape only)
    # drafter shape
    arch: str = "dflash"  # a new drafter's format (ARCHES); a resumed / --init drafter keeps its own, except
    # that "dflash2" starting a new run from a first-generation drafter makes a DFlash2 drafter of it
    layers: int = 3
    intermediate_size: int | None = None  # drafter MLP width; None: the target's
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: spread over the target (the z-lab format's rule)
    mask_token_id: int | None = None  # None: <|MASK|> when the tokenizer has it, else an unused special
    output_norm_init: float = 1.0  # initial weight of a new drafter's final norm (feeds the target's lm_head)
    # data
    max_seq_len: int = 1024
    batch_size: int | None = 8  # sequences per step (used when batch_tokens is None)
    batch_tokens: int | None = None  # padded tokens per step (wins over batch_size)
    anchors_per_seq: int = 64
    loss_gamma: float | None = None  # slot k weighs exp(-(k-1)/gamma); None: by block size; 0: no decay
    selector_loss_weight: float = 1.0  # DFlash2: weight of the candidate selector's loss beside the block loss
    selector_rank: int | None = None  # a new DFlash2 drafter's codebook width; None: the published 256
    heldout_percent: float = 2.0
    max_conversations: int | None = None  # cap on conversations read (quick runs)
    # optimization
    steps: int | None = None  # total optimizer steps (wins over epochs)
    epochs: float = 1.0
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100  # steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    time_budget_s: float | None = None  # total training wall time (resumes included); sets the cosine
    stop_after_s: float | None = None  # stop and save after this much wall time of this run (resume later)
    stop_after_steps: int | None = None  # stop and save after this many steps of this run (resume later)
    max_minutes: float | None = None  # stop, save and exit before this many minutes since the command began
    # runtime
    device: str | None = None
    dtype: str | None = None  # target dtype and autocast dtype on CUDA (default bf16)
    attention: str = "auto"  # auto (flex on CUDA, dense on CPU) | flex | dense
    eval_every: int = 200  # steps; 0 disables periodic eval
    eval_batches: int = 8
    save_every: int = 0  # steps; 0 saves at the end only
    save_dtype: str = "bfloat16"  # dtype of model.safetensors (float32 | bfloat16 | float16)
    max_shard_mb: float | None = None  # shard the weights (model-0000i-of-0000n + index) above this size
    log_every: int = 10
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
            if not self.target_layer_ids:
                raise ConfigError("--target-layer-ids must name at least one layer")
        self._check_positive("layers", "max_seq_len", "anchors_per_seq", "eval_batches", "log_every")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"--warmup must be an integer >= 0, got {self.warmup!r}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be an integer >= 2, got {self.block_size!r}")
        if self.batch_tokens is None and self.batch_size is None:
            raise ConfigError("give --batch-size or --batch-tokens")
        if self.batch_tokens is not None and self.batch_tokens < self.max_seq_len:
            raise ConfigError(f"--batch-tokens ({self.batch_tokens}) must be >= --max-seq-len ({self.max_seq_len}) "
                              f"so that every sequence fits in a batch")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if not self.epochs > 0:
            raise ConfigError(f"--epochs must be > 0, got {self.epochs}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.heldout_percent < 100:
            raise ConfigError(f"--heldout-percent must be in [0, 100), got {self.heldout_percent}")
        if self.arch not in ARCHES:
            raise ConfigError(f"--arch {self.arch!r}; allowed: {', '.join(ARCHES)}")
        if not (self.selector_loss_weight >= 0 and math.isfinite(self.selector_loss_weight)):
            raise ConfigError(f"--selector-loss-weight must be a number >= 0, got {self.selector_loss_weight}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"--attention {self.attention!r}; allowed: {', '.join(ATTENTION_KINDS)}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"--time-budget-s must be > 0, got {self.time_budget_s}")
        if self.stop_after_s is not None and self.stop_after_s <= 0:
            raise ConfigError(f"--stop-after-s must be > 0, got {self.stop_after_s}")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise ConfigError(f"--stop-after-steps must be >= 1, got {self.stop_after_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.loss_gamma is not None and not (self.loss_gamma >= 0 and math.isfinite(self.loss_gamma)):
            raise ConfigError(f"--loss-gamma must be a number >= 0 (0: no decay), got {self.loss_gamma}")
        if self.selector_rank is not None and (self.selector_rank < 1 or self.arch != "dflash2"):
            raise ConfigError(f"--selector-rank must be >= 1 and goes with --arch dflash2, got {self.selector_rank} "
                              f"with --arch {self.arch}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ConfigError(f"--intermediate-size must be >= 1, got {self.intermediate_size}")
        if self.resume is not None and self.init is not None:
            raise ConfigError("give --resume (continue a run) or --init (a new run from a drafter's weights), not both")
        if self.save_dtype not in SAVE_DTYPES:
            raise ConfigError(f"--save-dtype {self.save_dtype!r}; allowed: {', '.join(SAVE_DTYPES)}")
        if self.max_shard_mb is not None and not self.max_shard_mb > 0:
            raise ConfigError(f"--max-shard-mb must be > 0, got {self.max_shard_mb}")
        if self.eval_every < 0 or self.save_every < 0:
            raise ConfigError("--eval-every and --save-every must be >= 0 (0 disables)")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")

    def gamma(self, block_size: int) -> float:
        """The loss decay for a drafter of ``block_size`` (a resumed drafter keeps its own)."""
        return loss_gamma(block_size, self.loss_gamma)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
