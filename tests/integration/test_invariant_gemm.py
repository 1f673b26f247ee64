"""The row-invariant product (flashtree/kernels/gpu/gemm.py) in Triton's interpreter on the CPU: every
row is bit-identical whether the product has 1, 7 or 64 rows and whatever rows share it (float32;
the interpreter has no bfloat16 arithmetic: tests/gpu/test_invariant_gemm.py), and the product is
F.linear's up to rounding (issue #29). tests/support/gemm_checks.py runs in a subprocess: the
interpreter must be chosen before Triton compiles anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_rows_are_identical_whatever_the_row_count(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.support.gemm_checks"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["torch.float32"]["rows_identical"]
    assert results["torch.float32"]["max_abs_diff"] < 1e-3
