"""A target forward with a feature sink writes each new token's captured layers into the sink's
rows: exactly the features it returns without one (models/feature_sink.py). The fused Triton norm
that writes them in its kernel is compared with this torch path in tests/support/kernel_checks.py."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels.feature_sink import FeatureSink
from flashtree.models.batch import ForwardBatch, causal_mask
from tests.helpers import make_cache, ours_from_hf, tiny_hf_model


def _forward(model, capture, sink=None):
    """Prefill two prompts (rows of different lengths), then one decode token per row."""
    cache = make_cache(model)
    prompts = [[3, 14, 15, 92, 65], [79, 32]]
    width = max(len(p) for p in prompts)
    counts = torch.tensor([len(p) for p in prompts])
    slots = torch.tensor([2, 0])
    prefill = ForwardBatch(torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
                           torch.arange(width).expand(2, -1), slots, torch.zeros(2, dtype=torch.long),
                           causal_mask(counts, width), kv_len=width)
    model(prefill, cache)
    cache.advance(slots, counts)
    step = ForwardBatch(torch.tensor([[7], [11]]), counts[:, None], slots, counts,
                        torch.ones(2, 1, 1, dtype=torch.bool), kv_len=width + 1)
    return model(step, cache, capture_layers=capture, feature_sink=sink)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_a_sink_receives_the_features_the_forward_would_return(kernels):
    model = ours_from_hf(tiny_hf_model("qwen3_qknorm", layers=3))
    if kernels == "cpu" and not model.use_cpu_kernels():
        pytest.skip("the C++ kernels do not build here")
    capture = (2, 0)  # out of order, the last layer (taken after the final norm) included
    expected = _forward(model, capture)
    buffer = torch.zeros(5, expected.hidden.shape[-1])
    rows = torch.tensor([3, 1])
    sunk = _forward(model, capture, FeatureSink(buffer, rows))
    assert sunk.hidden is None
    assert torch.equal(sunk.logits, expected.logits)
    assert torch.equal(buffer[rows], expected.hidden[:, 0])
    others = [i for i in range(5) if i not in rows.tolist()]
    assert not buffer[others].any()  # nothing else written
