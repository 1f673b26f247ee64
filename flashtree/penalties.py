"""Logit adjustments before the target's choice: min_tokens and repetition / frequency / presence penalties.

They change the distribution the target chooses from, so speculation verifies every tree node
against the adjusted distribution of that node's own output position: a node at depth d sees the
row's output so far AND the drafted tokens on its path (its ancestors and itself), exactly the
tokens a plain decoder would have emitted before that position. Plain and speculative decoding
therefore choose from the same distributions, and stay lossless.

Glossary
- counts: per row, how often each token occurs in the output before the round ``[B, V]``.
- seen: per row, the tokens of the prompt or of the output before the round ``[B, V]`` (repetition penalty).
- stop mask: per row, the tokens that end the request (eos, end of turn, stop_token_ids), which
  min_tokens forbids before that many output tokens ``[slots, V]``.
- path tokens: per tree node, the drafted tokens from the root's child down to the node itself
  ``[B, N, D]`` (-1 padding); empty for the root (whose token is already in ``counts``).

The penalties follow vLLM's definitions: repetition (over prompt and output) divides a positive
logit by the penalty and multiplies a negative one; frequency subtracts ``penalty * count``;
presence subtracts ``penalty`` once a token occurred (both over the output only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotAdjustments(NamedTuple):
    """The per-slot adjustment state gathered for a round's rows (``[B, ...]`` each)."""

    counts: torch.Tensor  # [B, V] float32
    seen: torch.Tensor  # [B, V] bool
    stop_mask: torch.Tensor  # [B, V] bool
    min_tokens: torch.Tensor  # [B] int64, 0 = off
    presence: torch.Tensor  # [B] float32, 0 = off
    frequency: torch.Tensor  # [B] float32, 0 = off
    repetition: torch.Tensor  # [B] float32, 1 = off


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
    """``[B, N, depth]`` drafted tokens on each node's path (its ancestors below the root, and
    itself), -1 where the path is shorter. tokens, parents: ``[B, N]`` (the root is node 0, parent -1)."""
    num_rows, nodes = tokens.shape
    current = torch.arange(nodes, device=tokens.device).expand(num_rows, -1)  # [B, N]
    steps = []
    for _ in range(depth):
        on_path = current > 0  # the root's token is output already, not a drafted one
        steps.append(torch.where(on_path, tokens.gather(1, current.clamp(min=0)), -1))
        current = torch.where(on_path, parents.gather(1, current.clamp(min=0)), -1)
    return torch.stack(steps, dim=2) if steps else tokens.new_full((num_rows, nodes, 0), -1)


def adjust_logits(logits: torch.Tensor, out_index: torch.Tensor, state: SlotAdjustments,
                  paths: torch.Tensor | None = None) -> torch.Tensor:
    """Adjusted logits ``[B, M, V]`` for the choices at output indices ``out_index [B, M]``;
    ``paths [B, M, D]``: the drafted tokens each position's choice follows (None: none)."""
    counts = state.counts[:, None, :].float().expand_as(logits)  # [B, M, V]
    if paths is not None and paths.shape[2]:
        on_path = (paths >= 0).float()
        counts = counts + torch.zeros_like(logits).scatter_add(2, paths.clamp(min=0), on_path)
    seen = state.seen[:, None, :] | (counts > 0)  # [B, M, V]
    repetition = state.repetition[:, None, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - state.frequency[:, None, None] * counts - state.presence[:, None, None] * (counts > 0).float()
    too_early = (out_index < state.min_tokens[:, None])[:, :, None] & state.stop_mask[:, None, :]  # [B, M, V]
    return logits.masked_fill(too_early, float("-inf"))
