"""CUDA only: the fused Triton kernels against the plain torch ops they replace, in-process on
the GPU in fp32 and bf16 (tests/support/kernel_checks.py), and the lossless contract with them on.
One test per part, so that a part that compiles many Triton shapes gets its own verdict and time."""

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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])


@DTYPES
def test_fused_model_kernels_match_torch_ops(dtype, tolerance):
    _check(compare("cuda", dtype), tolerance)


@DTYPES
def test_fused_drafter_kernels_match_torch_ops(dtype, tolerance, tmp_path):
    _check(compare_drafter("cuda", dtype, str(tmp_path)), tolerance)


@DTYPES
def test_triton_attention_matches_torch_ops(dtype, tolerance):
    _check(compare_attention("cuda", dtype), tolerance)


@pytest.mark.parametrize("new", [1, 5, 16, 17, 65])
def test_triton_attention_matches_torch_ops_at_qwen3_heads(new):
    """The default launch (its tile by the query rows: 4 to 260 here) at Qwen3-8B's head layout in bf16."""
    _check(compare_attention("cuda", torch.bfloat16, heads=32, kv_heads=8, head_dim=128, new=new), 0.15)


def test_engine_with_every_kernel_on_is_lossless(tmp_path):
    _check(compare_engine("cuda", str(tmp_path)), 0.0)


def test_tree_kernels_build_the_torch_trees():
    _check(compare_tree("cuda", cases=200), 0.0)


def test_top_tokens_and_commit_kernels_match_torch():
    _check(compare_top_tokens("cuda") | compare_commit("cuda"), 1e-4)  # log-prob differences are floats
