"""Batches of encoded conversations: a deterministic, resumable order of padded batches.

An epoch shuffles the samples (seeded by ``seed`` and the epoch), groups neighbours of similar
length (inside windows of 32 batches, to cut padding without losing randomness), and cuts the
groups into batches of ``batch_size`` sequences or of at most ``batch_tokens`` padded tokens.
The order is a pure function of (samples, seed, epoch), so a resumed run that starts at the saved
position (epoch, batch) gets the batches the uninterrupted run would have got; the data's
fingerprint (a hash of every sample's tokens and mask, with the batching settings) tells whether
a resumed run reads the same data.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from flashtree.train.encode import EncodedConversation

SORT_WINDOW_BATCHES = 32
PAD_ID = 0


class TokenBatch(NamedTuple):
    input_ids: torch.Tensor  # [B, N] int64, padded with PAD_ID
    assistant_mask: torch.Tensor  # [B, N] bool, False on padding
    lengths: torch.Tensor  # [B] int64 real tokens per row


def collate(samples: Sequence[EncodedConversation]) -> TokenBatch:
    width = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, sample in enumerate(samples):
        ids[row, :sample.num_tokens] = sample.input_ids
        mask[row, :sample.num_tokens] = sample.assistant_mask
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.long)
    return TokenBatch(ids, mask, lengths)


def epoch_batches(lengths: Sequence[int], seed: int, epoch: int, batch_size: int | None,
                  batch_tokens: int | None) -> list[list[int]]:
    """Sample indices of every batch of one epoch, in training order."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    per_window = (batch_size or max(1, batch_tokens // max(1, max(lengths, default=1)))) * SORT_WINDOW_BATCHES
    batches: list[list[int]] = []
    for start in range(0, len(order), per_window):
        window = sorted(order[start:start + per_window], key=lambda i: lengths[i])
        batches.extend(_cut(window, lengths, batch_size, batch_tokens))
    rng.shuffle(batches)
    return batches


def _cut(indices: list[int], lengths: Sequence[int], batch_size: int | None, batch_tokens: int | None
         ) -> Iterator[list[int]]:
    if batch_tokens is None:
        for start in range(0, len(indices), batch_size):
            yield indices[start:start + batch_size]
        return
    current: list[int] = []
    width = 0
    for i in indices:
        new_width = max(width, lengths[i])
        if current and new_width * (len(current) + 1) > batch_tokens:
            yield current
            current, new_width = [], lengths[i]
        current.append(i)
        width = new_width
    if current:
        yield current


class BatchStream:
    """Endless (epoch after epoch) stream of :class:`TokenBatch`, resumable at any step."""

    def __init__(self, samples: Sequence[EncodedConversation], seed: int, batch_size: int | None,
                 batch_tokens: int | None):
        if not samples:
            raise ValueError("no training samples: the data has no usable assistant turns")
        self.samples = list(samples)
        self.lengths = [s.num_tokens for s in self.samples]
        self.seed, self.batch_size, self.batch_tokens = seed, batch_size, batch_tokens
        self.position = (0, 0)  # (epoch, batch index) of the next batch

    def batches_per_epoch(self) -> int:
        return len(epoch_batches(self.lengths, self.seed, 0, self.batch_size, self.batch_tokens))

    def iterate(self, start_step: int = 0, position: tuple[int, int] | None = None) -> Iterator[TokenBatch]:
        """Batches from global step ``start_step`` on (earlier steps are skipped, not built), or
        from ``position`` = (epoch, batch index in that epoch) when given. ``self.position`` is
        then the position of the next batch."""
        epoch, skip = position if position is not None else (0, start_step)
        while True:
            plan = epoch_batches(self.lengths, self.seed, epoch, self.batch_size, self.batch_tokens)
            for index in range(skip, len(plan)):
                self.position = (epoch, index + 1)
                yield collate([self.samples[i] for i in plan[index]])
            skip = max(0, skip - len(plan))
            epoch += 1

    def fingerprint(self) -> str:
        """sha256 over the samples' tokens and masks, in order, and the batching settings."""
        digest = hashlib.sha256(repr((self.seed, self.batch_size, self.batch_tokens, len(self.samples))).encode())
        for sample in self.samples:
            digest.update(sample.input_ids.numpy().tobytes())
            digest.update(sample.assistant_mask.numpy().tobytes())
        return digest.hexdigest()
