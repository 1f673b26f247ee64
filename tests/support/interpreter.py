"""Run a checks module under Triton's interpreter (``TRITON_INTERPRET=1``) on the CPU, in a subprocess: the
interpreter must be chosen before Triton compiles anything. The module prints its results as one JSON line
last; :func:`run_interpreted` returns them (and skips the test where Triton is not installed).

The interpreter computes ``tl.dot`` with ``numpy.matmul``, that is with the BLAS numpy was built with, whose
kernels choose their summation order by the operands' shapes and the CPU (OpenBLAS's Haswell kernels on an
AVX2 EPYC give a row a different result in a 1-row product than in a 4-row one). A GPU's MMA computes each
output from its own row and column alone, and the row-invariance checks test the kernels' design, not the
host's BLAS; so the subprocess first gives the interpreter :func:`row_invariant_dot`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOT = ("import runpy, sys; from tests.support.interpreter import row_invariant_dot; row_invariant_dot(); "
        "module = sys.argv[1]; sys.argv = sys.argv[1:]; runpy.run_module(module, run_name='__main__', alter_sys=True)")


def run_interpreted(module: str, *args: str, timeout: int = 600):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", BOOT, module, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def row_invariant_dot() -> None:
    """The interpreter's numpy, with ``matmul`` as an ``einsum`` (numpy's own loops: each output element summed in
    one order whatever the operands' other rows); every other name is numpy's."""
    import numpy
    from triton.runtime import interpreter

    def matmul(a, b, dtype=None):
        return numpy.einsum("...ij,...jk->...ik", a, b, dtype=dtype, casting="same_kind")

    shim = types.ModuleType("numpy_row_invariant_dot")
    shim.__dict__.update(numpy.__dict__)
    shim.matmul = matmul
    interpreter.np = shim
