"""Attention over the KV cache: the grouped-query fold used for prefill shapes on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from flashtree.models.attention import fold_query_groups, masked_attention, planless_attention
from tests.support.attention import prefill_like


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4)])
def test_folded_groups_give_grouped_query_attention(heads, kv_heads):
    q, keys, values, mask = prefill_like(heads=heads, kv_heads=kv_heads)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads)
    folded_q, folded_mask = fold_query_groups(q, mask, kv_heads)
    assert folded_q.shape == (3, kv_heads, heads // kv_heads * 5, 16)
    assert folded_mask.shape == (3, 1, heads // kv_heads * 5, mask.shape[-1])
    out = F.scaled_dot_product_attention(folded_q, keys, values, attn_mask=folded_mask)
    torch.testing.assert_close(out.reshape(q.shape), expected, rtol=1e-5, atol=1e-6)


def test_planless_attention_matches_masked_attention():
    q, keys, values, mask = prefill_like()
    expected = masked_attention(q, keys, values, mask)
    torch.testing.assert_close(planless_attention(q, keys, values, mask), expected, rtol=1e-5, atol=1e-6)
    # on the CPU a one-off shape takes the ordinary path: the very same values
    assert torch.equal(masked_attention(q, keys, values, mask, one_off_shape=True), expected)


def test_a_fold_that_mixed_up_heads_would_be_caught():
    """The check above can fail: pairing query heads with the wrong KV heads changes the output."""
    q, keys, values, mask = prefill_like()
    expected = masked_attention(q, keys, values, mask)
    wrong_q = q.reshape(3, 4, 2, 5, 16).transpose(1, 2).reshape(3, 2, 20, 16)  # head h -> KV head h % 2
    wrong = F.scaled_dot_product_attention(wrong_q, keys, values, attn_mask=fold_query_groups(q, mask, 2)[1])
    assert not torch.allclose(wrong.reshape(3, 2, 4, 5, 16).transpose(1, 2).reshape(q.shape), expected, atol=1e-3)
