"""A DFlash2 drafter with the Triton kernels on (fused layer ops, paged attention, tree build) in
Triton's interpreter on the CPU: its proposals are the torch path's and DFlash / DDTree tokens are
plain decoding's (tests/support/dflash2_kernel_checks.py, in a subprocess under TRITON_INTERPRET=1;
on CUDA: tests/gpu/test_dflash2_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # about 80 s of interpreted kernels
def test_dflash2_with_triton_kernels_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.support.dflash2_kernel_checks", str(tmp_path)], check=False, cwd=root,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    diffs = json.loads(out.stdout.strip().splitlines()[-1])
    assert diffs.pop("dflash2/max_score_difference") < 1e-3, diffs
    assert all(v == 0 for v in diffs.values()), diffs
