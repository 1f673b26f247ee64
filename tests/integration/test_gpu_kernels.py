"""The fused Triton kernels (flashtree/kernels/gpu) against the plain torch ops they replace, on
the CPU in Triton's interpreter: tests/support/kernel_checks.py runs in a subprocess under
``TRITON_INTERPRET=1`` (the interpreter must be chosen before Triton compiles anything), on tiny
random models, a drafter, attention, trees, top tokens, KV commits and a DDTree engine run.
(On CUDA the same checks run in-process: tests/gpu/test_fused_kernels.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kernel_checks import _check


def test_fused_kernels_match_torch_ops_in_the_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.support.kernel_checks", str(tmp_path)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(json.loads(out.stdout.strip().splitlines()[-1]), 1e-4)
