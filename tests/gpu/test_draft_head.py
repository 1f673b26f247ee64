"""CUDA only: a 16-bit target gives its drafter 16-bit draft logits (the tree build's radix top-k reads them as
they are), with the values of the float32 head the verify forward uses."""

import pytest
import torch

from tests.helpers import ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_draft_logits_keep_the_heads_dtype_and_values(dtype):
    target = ours_from_hf(tiny_hf_model("qwen3_qknorm"), device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, target.config.hidden_size, generator=gen).to("cuda", dtype)
    draft, full = target.draft_head(hidden), target.head(hidden)
    assert draft.dtype == dtype and full.dtype == torch.float32
    assert torch.equal(draft.float(), full)
