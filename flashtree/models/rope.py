"""Rotary position embeddings (the half-split "rotate_half" convention of Hugging Face Llama/Qwen)."""

from __future__ import annotations

import math

import torch

from flashtree.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """``[head_dim // 2]`` float64 inverse frequencies, with ``llama3`` scaling applied when set."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.rope_type != "llama3":
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """Precomputed cos/sin for positions ``0 .. max_positions-1``; grows on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, max_positions: int,
                 device: torch.device, dtype: torch.dtype):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim/2] float64
        self.device, self.dtype = device, dtype
        self._build(max_positions)

    def _build(self, max_positions: int) -> None:
        positions = torch.arange(max_positions, dtype=torch.float64)
        # Angles are formed in float32, as Hugging Face does, so logits match it closely.
        angles = torch.outer(positions.float(), self.inv_freq.float())
        angles = torch.cat([angles, angles], dim=-1)  # [P, head_dim]
        self.cos = angles.cos().to(self.device, self.dtype)  # [P, head_dim]
        self.sin = angles.sin().to(self.device, self.dtype)  # [P, head_dim]
        self.max_positions = max_positions

    def ensure(self, max_positions: int) -> None:
        if max_positions > self.max_positions:
            self._build(max(max_positions, 2 * self.max_positions))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[B, N]`` -> cos, sin ``[B, 1, N, head_dim]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, heads, N, head_dim]`` rotated by cos/sin ``[B, 1, N, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
