"""CUDA only: the row-invariant product gives every row bit-identically at M = 1, 7 and 64 in float32
and bfloat16, and F.linear's values up to rounding (the interpreter's check: tests/integration)."""

import pytest
import torch

from tests.support.gemm_checks import check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_rows_are_identical_whatever_the_row_count():
    results = check((torch.float32, torch.bfloat16), device="cuda")
    assert results["torch.float32"]["rows_identical"] and results["torch.bfloat16"]["rows_identical"]
    assert results["torch.float32"]["max_abs_diff"] < 1e-3
    assert results["torch.bfloat16"]["max_abs_diff"] < 0.5  # one bf16 rounding of |y| up to ~40
