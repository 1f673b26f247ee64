"""CUDA only: the exact mode (issue #29) in float32 and bfloat16. The exact attention gives a tree node what a
plain step at its position gets and a row what it gets alone; the exact model's logits are the unfused model's
up to rounding; plain decoding, the DFlash chain and DDTree give the same greedy tokens, alone and in a batch;
plain decoding repeats pass to pass and copy to copy at batch 1, 16 and 64; over 4,096 new tokens at batch 1, 16
and 64, DFlash and DDTree-16 / 64 / 256 give plain decoding's bf16 tokens."""

import pytest
import torch

from tests.support.exact_attention_checks import check as check_attention
from tests.support.exact_mode_checks import (EXACT_FAMILIES, compare_exact_engine, methods_over_many_tokens,
                                             plain_repeatability)
from tests.support.kernel_checks import _check, compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_exact_attention_depends_only_on_a_querys_logical_keys():
    results = check_attention((torch.float32, torch.bfloat16), device="cuda")
    for dtype, bound in (("torch.float32", 1e-4), ("torch.bfloat16", 0.05)):
        assert results[dtype]["tree_equals_plain"] and results[dtype]["batch_and_chunk_invariant"], results
        assert results[dtype]["parallel_equals_sequential"] and results[dtype]["every_tile_agrees"], results
        assert results[dtype]["max_abs_diff"] < bound, results


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_exact_logits_are_the_unfused_models_up_to_rounding(dtype, tolerance):
    _check(compare("cuda", dtype, backend="exact", families=EXACT_FAMILIES), tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_tokens_equal_plain_tokens(dtype, tmp_path):
    differing = compare_exact_engine("cuda", str(tmp_path), dtype=dtype, max_tokens=32)
    assert not any(differing.values()), differing


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_plain_decoding_repeats_in_bf16(batch, tmp_path):
    differing = plain_repeatability("cuda", str(tmp_path), "bfloat16", batch)
    assert not any(differing.values()), differing


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_every_method_equals_plain_over_4096_tokens_in_bf16(batch, tmp_path):
    differing = methods_over_many_tokens("cuda", str(tmp_path), "bfloat16", batch)
    assert differing.pop("tokens_compared") == 4096 // batch * batch
    assert not any(differing.values()), differing
