"""A DFlash2 drafter's training loss: the block loss on its unary scores plus its selector's loss.

- block loss: :func:`flashtree.train.loss.block_loss`'s position-decayed cross-entropy over the
  whole vocabulary, of the unary scores ``u = c * tanh(m * z / c)`` (``models/dflash2.py``; the
  logits themselves for a new drafter, m = 1 and no cap);
- selector loss: at every labelled slot, a cross-entropy over the slot's ``selector_top_k``
  candidates (by lm_head logit) of the selector's scores ``s(p, c)`` with p the TRUE previous
  token (the bonus token at slot 1), whose label is the true token's place among the candidates;
  a slot whose true token is not a candidate has nothing to select and carries no selector loss.
  Same position weights, averaged over the slots that carry it;
- loss = block loss + ``selector_loss_weight`` x selector loss;
- correctness (acc@k, the tau estimate): the selector's choice after the true previous token is
  the label, what the engine's walk proposes as long as its draft is right.

Shapes: B sequences, A anchors, L = b-1 drafted slots, M labelled slots, k candidates, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.train.anchors import AnchorBlocks
from flashtree.train.loss import BlockLoss, correctness_stats, slot_weights


def dflash2_block_loss(drafter: DFlash2Drafter, hidden: torch.Tensor, blocks: AnchorBlocks, gamma: float,
                       selector_weight: float) -> BlockLoss:
    """hidden: ``[B, A, L, H]`` normed drafter outputs at slots 1..b-1 (``training_hidden``)."""
    labels, label_mask = blocks.labels, blocks.label_mask  # [B, A, L] x2
    weights = slot_weights(labels.shape[-1], gamma, hidden.device).expand_as(labels)[label_mask]  # [M]
    picked = label_mask.nonzero(as_tuple=True)
    targets = labels[picked]  # [M]
    logits = drafter.target.head(hidden[picked])  # [M, V]
    block = _weighted_mean(F.cross_entropy(drafter.unary_scores(logits), targets, reduction="none"), weights)
    previous = torch.cat([blocks.block_ids[:, :, :1], labels[:, :, :-1]], dim=2)[picked]  # [M] true previous tokens
    unary, candidates = drafter.unary(logits)  # [M, k] x2
    selector = drafter.candidate_selector
    scores = selector.edge_scores(previous, selector.hidden_projection(hidden[picked]), candidates, unary)  # [M, k]
    is_label = candidates == targets[:, None]  # [M, k]
    selectable = is_label.any(dim=-1)  # [M]
    choice = is_label.float().argmax(dim=-1)  # [M] the label's place (0 where it is no candidate)
    chosen = F.cross_entropy(scores, choice, reduction="none")  # [M]
    loss = block + selector_weight * _weighted_mean(chosen[selectable], weights[selectable])
    correct = torch.zeros_like(label_mask)
    correct[picked] = selectable & (scores.argmax(dim=-1) == choice)  # [B, A, L]
    return BlockLoss(loss, *correctness_stats(correct.detach(), label_mask))


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1e-6)
