"""A target forward with a feature sink writes each new token's captured layers into the sink's
rows: exactly the features it returns without one (models/feature_sink.py). The fused Triton norm
that writes them in its kernel is compared with this torch path in tests/support/kernel_checks.py."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels.feature_sink import FeatureSink
from tests.helpers import ours_from_hf, prefill_then_step, tiny_hf_model


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_a_sink_receives_the_features_the_forward_would_return(kernels):
    model = ours_from_hf(tiny_hf_model("qwen3_qknorm", layers=3))
    if kernels == "cpu" and not model.use_cpu_kernels():
        pytest.skip("the C++ kernels do not build here")
    capture = (2, 0)  # out of order, the last layer (taken after the final norm) included
    expected = prefill_then_step(model, capture)
    buffer = torch.zeros(5, expected.hidden.shape[-1])
    rows = torch.tensor([3, 1])
    sunk = prefill_then_step(model, capture, FeatureSink(buffer, rows))
    assert sunk.hidden is None
    assert torch.equal(sunk.logits, expected.logits)
    assert torch.equal(buffer[rows], expected.hidden[:, 0])
    others = [i for i in range(5) if i not in rows.tolist()]
    assert not buffer[others].any()  # nothing else written
