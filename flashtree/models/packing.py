"""TokenPacking: a verify forward's rows packed into one flat token batch (the ragged layout).

The rows of a round verify different numbers of tokens: each row's tree keeps its own budget, a pad
row verifies nothing. The padded layout runs every row at the widest row's width, ``[B, N]`` tokens.
The ragged layout runs the products (embedding, projections, MLP, LM head) over the rows' real
tokens only, packed row after row into a flat batch of a fixed size T (a CUDA graph's key); the
attention keeps the padded ``[B, N]`` layout of the tree masks and the KV writes, so each layer
scatters its projected q/k/v there and gathers the attention's output back.

Glossary
- counts: ``[B]`` real tokens of each row, a prefix of its node axis (0 for a pad row).
- flat position: a token's place in the packed batch (row after row, each row's tokens in order).
- padded index: ``b * N + j``, entry j of row b in the padded layout; ``B * N`` is the dump, where a
  flat pad token (past the rows' total) points.
- unpacked entry: a padded entry whose flat position would be T or more (the total overflows T), or
  past its row's count. The round marks such tree nodes invalid, so nothing reads their results, and no
  packed token attends to one (a packed node's ancestors come before it in its row: packed too).

Pure device work (no host sync), so it runs inside a graphed round.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenPacking(NamedTuple):
    flat_of: torch.Tensor  # [B, N] int64: flat position of each padded entry; T where it is not packed
    padded_of: torch.Tensor  # [T] int64: padded index of each flat token; B * N for a flat pad token
    row_of: torch.Tensor  # [T] int64: row of each flat token (a flat pad token: the last row)
    counts: torch.Tensor  # [B] int64: packed tokens of each row (its first entries)

    @property
    def total(self) -> int:
        """T, the flat batch's size."""
        return self.padded_of.shape[0]

    @property
    def packed(self) -> torch.Tensor:
        """``[B, N]`` bool: the padded entries that have a flat position."""
        return self.flat_of < self.total

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, N, ...]`` -> ``[T, ...]``: each flat token's entry (a flat pad token gets the last entry)."""
        rows, width = padded.shape[:2]
        return padded.reshape(rows * width, *padded.shape[2:])[self.padded_of.clamp(max=rows * width - 1)]

    def scatter(self, flat: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """``[T, ...]`` -> ``[B, N, ...]``: each flat token at its padded entry; an unpacked entry gets the last
        flat token's values (finite, and never read: no packed token sees an unpacked one). One gather."""
        return flat[self.flat_of.clamp(max=self.total - 1).reshape(-1)].view(rows, width, *flat.shape[1:])

    def at(self, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``flat [T, ...]`` at the padded entries ``index [B, M]`` (node indices of each row) -> ``[B, M, ...]``;
        an unpacked entry reads the last flat token (callers keep only packed ones)."""
        positions = self.flat_of.gather(1, index).clamp(max=self.total - 1)  # [B, M]
        return flat[positions.reshape(-1)].view(*index.shape, *flat.shape[1:])


def pack_rows(counts: torch.Tensor, width: int, total: int) -> TokenPacking:
    """The packing of rows with ``counts [B]`` real tokens (each ``<= width``) into ``total`` flat tokens.

    Rows are packed in order; tokens past ``total`` stay unpacked (the caller's budgets normally keep
    the sum within it). ``total`` >= 1."""
    if counts.dim() != 1:
        raise ValueError(f"counts must be [B], got shape {tuple(counts.shape)}")
    if width < 1 or total < 1:
        raise ValueError(f"width and total must be >= 1, got width {width}, total {total}")
    rows, device = counts.shape[0], counts.device
    counts = counts.clamp(0, width)  # [B]
    starts = counts.cumsum(0) - counts  # [B] flat position of each row's first token
    entry = torch.arange(width, device=device)  # [N]
    flat = starts[:, None] + entry[None, :]  # [B, N]
    flat_of = torch.where((entry[None, :] < counts[:, None]) & (flat < total), flat, total)  # [B, N]
    dump = rows * width
    padded_of = torch.full((total + 1,), dump, dtype=torch.long, device=device)  # [T + 1]; T: where unpacked go
    padded_of.scatter_(0, flat_of.reshape(-1), torch.arange(dump, device=device))
    padded_of = padded_of[:total]  # [T]
    row_of = (padded_of // width).clamp(max=rows - 1)  # [T]
    return TokenPacking(flat_of, padded_of, row_of, (flat_of < total).sum(dim=1))
