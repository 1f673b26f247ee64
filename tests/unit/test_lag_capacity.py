"""How many committed tokens a drafter's context may lag behind (speculative/drafter.py): a GPU keeps
the short capacity its full-width catch-up graph pays for; a CPU defers longer while the lag buffer
stays small, and never less than the GPU's."""

from __future__ import annotations

import torch

from flashtree.speculative.drafter import (
    CPU_LAG_BYTES,
    CPU_LAG_CAPACITY,
    LAG_CAPACITY,
    lag_capacity,
)

SMOLLM2_FEATURES = 3 * 576 * 4  # three captured layers of 576 fp32 values


def test_a_gpu_keeps_the_short_capacity():
    assert lag_capacity(torch.device("cuda", 0), 2, SMOLLM2_FEATURES) == LAG_CAPACITY


def test_a_cpu_defers_longer_within_its_memory():
    assert lag_capacity(torch.device("cpu"), 2, SMOLLM2_FEATURES) == CPU_LAG_CAPACITY > LAG_CAPACITY
    wide = 5 * 2048 * 4  # a 1.7B target's drafter: five layers of 2048
    slots = 9
    capacity = lag_capacity(torch.device("cpu"), slots, wide)
    assert LAG_CAPACITY < capacity < CPU_LAG_CAPACITY
    assert slots * (capacity + 1) * wide <= CPU_LAG_BYTES < slots * (capacity + 2) * wide
    assert lag_capacity(torch.device("cpu"), 64, wide) == LAG_CAPACITY  # (never below the short one)
