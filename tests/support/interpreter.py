"""Run a checks module under Triton's interpreter (``TRITON_INTERPRET=1``) on the CPU, in a subprocess: the
interpreter must be chosen before Triton compiles anything. The module prints its results as one JSON line
last; :func:`run_interpreted` returns them (and skips the test where Triton is not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: str, timeout: int = 600):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
