"""The row-invariant product (flashtree/kernels/gpu/gemm.py) in Triton's interpreter on the CPU: every
row is bit-identical whether the product has 1, 7 or 64 rows and whatever rows share it (float32;
the interpreter has no bfloat16 arithmetic: tests/gpu/test_invariant_gemm.py), and the product is
F.linear's up to rounding (issue #29). tests/support/gemm_checks.py runs in a subprocess: the
interpreter must be chosen before Triton compiles anything."""

from __future__ import annotations

from tests.support.interpreter import run_interpreted


def test_rows_are_identical_whatever_the_row_count(tmp_path):
    results = run_interpreted("tests.support.gemm_checks", timeout=300)
    assert results["torch.float32"]["rows_identical"] and results["torch.float32"]["chunks_identical"]
    assert results["torch.float32"]["max_abs_diff"] < 1e-3
