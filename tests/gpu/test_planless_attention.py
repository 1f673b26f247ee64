"""CUDA only: prefill's planless attention agrees with PyTorch's own choice (cuDNN in bf16)."""

import pytest
import torch

from flashtree.models.attention import masked_attention, planless_attention
from tests.support.attention import prefill_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_planless_attention_matches_default_on_cuda(dtype, tol):
    q, keys, values, mask = (t.cuda() for t in prefill_like(heads=32, kv_heads=8, dim=128))
    q, keys, values = (t.to(dtype) for t in (q, keys, values))
    bias = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill_(~mask, float("-inf"))
    expected = masked_attention(q, keys, values, bias)
    out = masked_attention(q, keys, values, bias, one_off_shape=True)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(planless_attention(q, keys, values, bias), out, rtol=0, atol=0)
