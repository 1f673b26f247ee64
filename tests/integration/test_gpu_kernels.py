"""The fused Triton kernels (flashtree/kernels/gpu) against the plain torch ops they replace, on
the CPU in Triton's interpreter: tests/support/kernel_checks.py runs in a subprocess under
``TRITON_INTERPRET=1`` (the interpreter must be chosen before Triton compiles anything), on tiny
random models, a drafter, attention, trees, top tokens, KV commits and a DDTree engine run.
(On CUDA the same checks run in-process: tests/gpu/test_fused_kernels.py.)"""

from __future__ import annotations

from tests.support.interpreter import run_interpreted
from tests.support.kernel_checks import _check


def test_fused_kernels_match_torch_ops_in_the_triton_interpreter(tmp_path):
    _check(run_interpreted("tests.support.kernel_checks", str(tmp_path)), 1e-4)
