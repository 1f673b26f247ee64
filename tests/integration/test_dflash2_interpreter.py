"""A DFlash2 drafter with the Triton kernels on (fused layer ops, paged attention, tree build) in
Triton's interpreter on the CPU: its proposals are the torch path's and DFlash / DDTree tokens are
plain decoding's (tests/support/dflash2_kernel_checks.py, in a subprocess under TRITON_INTERPRET=1;
on CUDA: tests/gpu/test_dflash2_gpu.py)."""

from __future__ import annotations

import pytest

from tests.support.interpreter import run_interpreted


@pytest.mark.slow  # about 80 s of interpreted kernels
def test_dflash2_with_triton_kernels_in_the_interpreter(tmp_path):
    diffs = run_interpreted("tests.support.dflash2_kernel_checks", str(tmp_path), timeout=900)
    assert diffs.pop("dflash2/max_score_difference") < 1e-3, diffs
    assert all(v == 0 for v in diffs.values()), diffs
