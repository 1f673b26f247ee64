"""Where a target forward writes its captured layers' outputs, instead of returning them.

A speculative engine's plain round keeps each new token's context features (the outputs of the
drafter's ``target_layer_ids``, side by side) in the drafter's lag buffer, one row per token. Returned
as one tensor, that costs a concatenation and a scatter after the forward; written straight into
the buffer's rows by the kernel that computes them (the fused residual-add + norm, which makes the
sum anyway), it costs no extra kernel.

Glossary:
- buffer: ``[R, F]`` rows of ``F = len(layers) * hidden`` features (a 2-D view of the lag buffer);
- rows: ``[B * N]`` the buffer row of each new token, in the forward's ``[B, N]`` order;
- segment: the ``hidden`` columns one captured layer fills (layer k of the list: columns
  ``k * hidden .. (k + 1) * hidden``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SinkSegment(NamedTuple):
    columns: torch.Tensor  # [R, hidden], a column slice of the buffer (row stride F)
    rows: torch.Tensor  # [B * N] long

    def write(self, values: torch.Tensor) -> None:
        """Put ``values [B, N, hidden]`` into their rows (the path without a fused kernel)."""
        self.columns.index_copy_(0, self.rows, values.reshape(-1, values.shape[-1]).to(self.columns.dtype))


class FeatureSink(NamedTuple):
    buffer: torch.Tensor  # [R, len(layers) * hidden]
    rows: torch.Tensor  # [B * N] long

    def segment(self, index: int, width: int) -> SinkSegment:
        """The columns of the ``index``-th captured layer (``width`` = the target's hidden size)."""
        return SinkSegment(self.buffer[:, index * width:(index + 1) * width], self.rows)
