"""A draft vocabulary: the drafter proposes only the N most frequent tokens (FR-Spec's idea).

The drafter's lm_head (the target's) over a whole vocabulary is a large part of a CPU draft: for
SmolLM2's 49,152 tokens, 1.36 ms of the lm_head and 0.79 ms of top-k and log-normalizer per
DDTree-4 round, of a 20 ms round on a 2-core CPU. Over the 16,384 most
frequent tokens of the drafter's training answers they take 0.62 ms together, and 95.6% of the
target's greedy output tokens are still among them. A token outside can never be drafted, so the
cost is some acceptance; verification is untouched, so decoding stays exactly lossless.

Glossary
- ranking: every token id the drafter's training answers hold, most frequent first (ties by id),
  in ``draft_vocab.safetensors`` beside the drafter's weights (tensor ``token_ids``, int64 [M];
  ``flashtree.train.draft_vocab`` writes it).
- draft vocabulary: the first N ids of the ranking; the drafter's logits are over draft indices
  ``0 .. N-1``, and ``token_ids[index]`` is the token a draft index stands for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from flashtree.errors import CheckpointError, ConfigError
from flashtree.kernels.cpu.quant_linear import QuantizedLinear, linear

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
RANKING_KEY = "token_ids"
# the CPU default where the drafter ships a ranking: with the shipped SmolLM2 drafter DDTree-4's tau moves
# 2.336 -> 2.342 on held-out ShareGPT and 1.932 -> 1.887 on HumanEval, and tokens/s +8% / +4%; the GPU
# keeps the whole vocabulary (its draft head is cheap)
CPU_DEFAULT_SIZE = 16_384


def default_size(requested: int | None, device: torch.device, drafter_dir: Path) -> int | None:
    """The draft vocabulary's size: ``requested`` (0: the whole vocabulary, returned as None), or by
    default :data:`CPU_DEFAULT_SIZE` on a CPU when the drafter ships a ranking, else None."""
    if requested is not None:
        return requested or None
    if torch.device(device).type == "cpu" and (Path(drafter_dir) / DRAFT_VOCAB_FILE).is_file():
        return CPU_DEFAULT_SIZE
    return None


def load_draft_vocab(drafter_dir: Path, size: int, vocab_size: int, at_most: bool = False) -> torch.Tensor:
    """The first ``size`` ids of the drafter's ranking, ``[size]`` int64 (CPU), checked against
    the target's ``vocab_size``; ``at_most``: fewer when the ranking is shorter (a default size)."""
    from safetensors.torch import load_file

    path = Path(drafter_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise ConfigError(f"--draft-vocab {size}: {path} not found; it holds the drafter's token ranking "
                          "(write it with python -m flashtree.train.draft_vocab)")
    tensors = load_file(str(path))
    if RANKING_KEY not in tensors:
        raise CheckpointError(f"{path}: no tensor {RANKING_KEY!r} (found {sorted(tensors)})")
    ranking = tensors[RANKING_KEY]
    if ranking.dim() != 1 or ranking.dtype != torch.int64:
        raise CheckpointError(f"{path}: {RANKING_KEY!r} must be a 1-D int64 tensor, got {ranking.dtype} "
                              f"{list(ranking.shape)}")
    if ranking.numel() and (int(ranking.min()) < 0 or int(ranking.max()) >= vocab_size):
        raise CheckpointError(f"{path}: token ids must be in [0, {vocab_size}) (the target's vocabulary)")
    if torch.unique(ranking).numel() != ranking.numel():
        raise CheckpointError(f"{path}: the ranking repeats token ids")
    if at_most:
        size = min(size, ranking.numel())
    if not 1 <= size <= ranking.numel():
        raise ConfigError(f"--draft-vocab must be in [1, {ranking.numel()}] (the tokens {path.name} ranks), got {size}")
    return ranking[:size].clone()


def vocab_head(lm_head_weight: torch.Tensor, lm_head_quant: QuantizedLinear | None,
               token_ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's lm_head restricted to ``token_ids`` (its rows copied once): normed hidden
    ``[..., hidden]`` -> float logits ``[..., N]`` over draft indices. A CPU model's GGUF blocks
    (its fp32 weight is then empty) are restricted the same way, so the draft keeps the block kernel."""
    if lm_head_quant is not None:
        blocks = lm_head_quant.blocks.index_select(0, token_ids.cpu()).contiguous()  # [N, K / 32 * block]
        quant = QuantizedLinear(lm_head_quant.type_name, blocks, lm_head_quant.in_features)
        return lambda hidden: quant(hidden)
    weight = lm_head_weight.index_select(0, token_ids.to(lm_head_weight.device)).contiguous()  # [N, hidden]
    return lambda hidden: linear(hidden, weight).float()
