"""Host-to-device copies that do not wait for the device.

On CUDA, copying a tensor from pageable host memory makes the host wait until every queued
kernel has run; a copy from pinned (page-locked) memory can be queued behind them instead. The
engine queues a round and then does host work while the device runs it, so every small tensor it
sends between rounds goes this way.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; on CUDA a non-blocking copy from pinned memory (the host tensor must
    not be changed afterwards; a new one per call, as here, never is)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
