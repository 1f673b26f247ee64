"""Wall time per stage of the engine's work (prefill, round, and with ``profile_stages`` a round's draft,
verify and commit)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StageTimer:
    """Adds up wall time per stage; synchronizes the device around stages only when ``sync`` (a
    profiling mode: rounds then run eagerly, since nothing may synchronize inside a CUDA graph)."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    def mark(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, stage: str, since: float) -> float:
        now = self.mark()
        self.seconds[stage] += now - since
        return now
