"""The CPU layer stack (every decoder layer of a short forward in one C++ call) gives exactly what the
layer-by-layer path gives: the same tokens and bit-identical log-probabilities in plain decoding and
under speculation (whose rounds capture the drafter's layers), on tiny GGUF models of each family."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.feature_sink import FeatureSink
from flashtree.models.loader import resolve_model_dir
from tests.dflash_helpers import save_tiny_drafter
from tests.helpers import prefill_then_step
from tests.support.checkpoints import isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)

AVAILABLE, WHY = kernels_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU kernel library unavailable: {WHY}")

PROMPTS = [[1, 5, 7], list(range(3, 20)), [9, 9, 9, 4], [30, 2, 60, 61, 62]]


def outputs(llm: LLM, params: SamplingParams):
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_layer_stack_equals_layer_by_layer(tmp_path, model_type):
    path = str(tiny_gguf(tmp_path / f"{model_type}.gguf", model_type=model_type))
    engine = dict(device="cpu", max_running=4, max_context=96, prefill_chunk=8, adaptive_spec=False)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    stacked = LLM(path, **engine)
    assert stacked.engine.model.layer_stack is not None
    by_layer = LLM(path, cpu_layer_stack=False, **engine)
    assert by_layer.engine.model.layer_stack is None
    expected = outputs(by_layer, params)
    assert outputs(stacked, params) == expected
    drafter = save_tiny_drafter(resolve_model_dir(path), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 6)):
        on = LLM(path, spec=spec, draft=str(drafter), budget=budget, **engine)
        off = LLM(path, spec=spec, draft=str(drafter), budget=budget, cpu_layer_stack=False, **engine)
        assert on.engine.model.layer_stack is not None
        assert [o[0] for o in outputs(on, params)] == [o[0] for o in expected], (spec, budget)
        assert outputs(on, params) == outputs(off, params), (spec, budget)


def test_layer_stack_off_without_blocks(tmp_path):
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    llm = LLM(path, device="cpu", max_running=2, max_context=64, quant_kernels=False)
    assert llm.engine.model.layer_stack is None


def test_layer_stack_writes_a_sink_in_place(tmp_path):
    """A plain round's captured layers go from the stack's kernel straight into the sink's rows
    (column slices of the lag buffer, rows out of order): exactly what the forward returns without a
    sink, nothing else written; a row past the buffer is refused."""
    path = str(tiny_gguf(tmp_path / "qwen3.gguf", model_type="qwen3"))
    model = LLM(path, device="cpu", max_running=2, max_context=64).engine.model
    real, rows_given = model.layer_stack, []
    model.layer_stack = lambda *args, **kwargs: rows_given.append(kwargs.get("capture_rows")) or real(*args, **kwargs)
    capture = (1, 0, 2)  # the last layer (taken after the final norm) among them
    expected = prefill_then_step(model, capture)
    buffer = torch.zeros(6, expected.hidden.shape[-1])
    rows = torch.tensor([4, 1])
    sunk = prefill_then_step(model, capture, FeatureSink(buffer, rows))
    assert rows_given[-1] is rows  # (the step ran in the stack, writing the sink itself)
    assert sunk.hidden is None and torch.equal(sunk.logits, expected.logits)
    assert torch.equal(buffer[rows], expected.hidden[:, 0])
    assert not buffer[[0, 2, 3, 5]].any()
    with pytest.raises(ValueError, match="capture_rows holds a row outside"):
        prefill_then_step(model, capture, FeatureSink(torch.zeros(4, buffer.shape[1]), rows))
