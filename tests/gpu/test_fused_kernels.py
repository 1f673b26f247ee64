"""CUDA only: the fused Triton kernels against the plain torch ops they replace, in-process on
the GPU in fp32 and bf16 (tests/support/kernel_checks.py), and the lossless contract with them on."""

import pytest
import torch

from tests.support.kernel_checks import (
    _check,
    compare,
    compare_attention,
    compare_commit,
    compare_drafter,
    compare_engine,
    compare_top_tokens,
    compare_tree,
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_fused_kernels_match_torch_ops_on_cuda(dtype, tolerance, tmp_path):
    diffs = compare("cuda", dtype) | compare_drafter("cuda", dtype, str(tmp_path)) | compare_attention("cuda", dtype)
    diffs |= compare_engine("cuda", str(tmp_path))  # exact in either dtype
    if dtype == torch.float32:
        diffs |= compare_tree("cuda", cases=200) | compare_top_tokens("cuda") | compare_commit("cuda")
    _check(diffs, tolerance)
