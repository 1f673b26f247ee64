"""The Triton tree kernels agree with the torch and host paths when a round's rows keep different
numbers of nodes (tests/support/row_budget_kernel_checks.py), on the CPU in Triton's interpreter (a
subprocess: the interpreter must be chosen before Triton compiles anything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_tree_kernels_take_per_row_budgets_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.support.row_budget_kernel_checks"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    mixed = result.pop("row_budgets/rounds_with_mixed_sizes")
    assert mixed >= 10, result  # the checks did build rounds whose rows differ in size
    assert not any(result.values()), result
