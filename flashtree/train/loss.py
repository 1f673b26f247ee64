"""The drafter's training loss and its metrics.

- loss: cross-entropy on slots k = 1..b-1 weighted ``exp(-(k-1)/gamma)`` (early slots matter
  more: a draft is accepted only up to its first miss), averaged over the labelled slots.
- slot accuracy: argmax == label per slot (acc@1 is the first drafted token).
- tau estimate: the expected DFlash acceptance length of a block from its per-slot correctness,
  ``1 + sum_k prod_{j<=k} correct_j`` (the bonus token plus the accepted prefix), averaged over
  blocks. Slots without a label count as misses, so short blocks are not flattered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class BlockLoss(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    slot_correct: torch.Tensor  # [b-1] float: correct labelled predictions per slot
    slot_count: torch.Tensor  # [b-1] float: labelled slots per slot index
    accepted: torch.Tensor  # scalar float: sum over blocks of (1 + accepted prefix length)
    blocks: torch.Tensor  # scalar float: blocks with at least one label


def slot_weights(horizon: int, gamma: float, device=None) -> torch.Tensor:
    """``[b-1]`` weights ``exp(-(k-1)/gamma)`` for k = 1..b-1."""
    k = torch.arange(horizon, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def block_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
               label_mask: torch.Tensor, gamma: float) -> BlockLoss:
    """hidden: ``[B, A, b-1, H]`` normed drafter outputs at slots 1..b-1; head maps ``[M, H]`` to
    logits ``[M, V]``; labels, label_mask: ``[B, A, b-1]``. Logits are made for labelled slots only."""
    horizon = labels.shape[-1]
    weights = slot_weights(horizon, gamma, hidden.device).expand_as(labels)  # [B, A, b-1]
    picked = label_mask.nonzero(as_tuple=True)
    logits = head(hidden[picked]).float()  # [M, V]
    targets = labels[picked]  # [M]
    ce = F.cross_entropy(logits, targets, reduction="none")  # [M]
    w = weights[picked]  # [M]
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    correct = torch.zeros_like(label_mask)
    correct[picked] = logits.argmax(-1) == targets  # [B, A, b-1]
    return BlockLoss(loss, *correctness_stats(correct.detach(), label_mask))


def correctness_stats(correct: torch.Tensor, label_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_correct [b-1], slot_count [b-1], accepted, blocks) from ``[B, A, b-1]`` bools."""
    hit = correct & label_mask
    slot_correct = hit.flatten(0, 1).float().sum(0)
    slot_count = label_mask.flatten(0, 1).float().sum(0)
    has_label = label_mask[..., 0]  # [B, A]
    prefix = torch.cumprod(hit.long(), dim=2).sum(2)  # [B, A] accepted drafts
    accepted = ((1 + prefix) * has_label).sum().float()
    return slot_correct, slot_count, accepted, has_label.sum().float()


class MetricTotals:
    """Running sums of :class:`BlockLoss` parts; read them as loss / acc@k / tau."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.batches = 0
        self.slot_correct = None
        self.slot_count = None
        self.accepted = 0.0
        self.blocks = 0.0

    def add(self, result: BlockLoss) -> None:
        self.loss_sum += float(result.loss.detach())
        self.batches += 1
        correct, count = result.slot_correct.detach().cpu(), result.slot_count.detach().cpu()
        self.slot_correct = correct if self.slot_correct is None else self.slot_correct + correct
        self.slot_count = count if self.slot_count is None else self.slot_count + count
        self.accepted += float(result.accepted)
        self.blocks += float(result.blocks)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.batches if self.batches else math.nan

    def slot_accuracy(self) -> list[float]:
        if self.slot_correct is None:
            return []
        return (self.slot_correct / self.slot_count.clamp(min=1)).tolist()

    @property
    def tau(self) -> float:
        return self.accepted / self.blocks if self.blocks else math.nan

    def summary(self) -> dict:
        acc = self.slot_accuracy()
        return {"loss": self.loss, "acc1": acc[0] if acc else math.nan, "tau": self.tau,
                "slot_accuracy": [round(a, 4) for a in acc]}
