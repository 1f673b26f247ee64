"""The CPU block kernel in the engine: with it (and float activations), the engine returns the same greedy
tokens as without it (tiny GGUF models and the embedded SmolLM2), and speculative decoding with it equals
plain decoding with it. The kernel's numerics and the blocks the loader keeps:
tests/unit/test_cpu_quant_linear.py; int8 activations: tests/*/test_cpu_int8_activations.py."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu.library import kernels_available
from flashtree.models.loader import resolve_model_dir
from tests.dflash_helpers import save_tiny_drafter, use_copying_proposer
from tests.support.checkpoints import holders, isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)

AVAILABLE, WHY = kernels_available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"CPU block kernel unavailable: {WHY}")
# a fixed node count per round where the engine has an adaptive policy (so every round speculates)
FIXED_NODES = {"adaptive_spec": False}


PROMPTS = [[1, 5, 7], list(range(3, 20)), [9, 9, 9, 4], [30, 2, 60, 61, 62]]


@needs_kernel
def test_kernel_keeps_greedy_tokens_and_speculation_stays_exact(tmp_path, monkeypatch):
    """Plain decoding with the kernel (float activations) equals plain decoding without it; DFlash and
    DDTree (random drafter; trees of up to 8 and of more nodes) and a copying drafter (deep acceptance)
    with the kernel (int8 activations, the default) equal plain decoding with it."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    engine = dict(device="cpu", max_running=4, max_context=96, prefill_chunk=8, **FIXED_NODES)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    float_x = LLM(path, int8_activations=False, **engine)
    assert float_x.engine.model.lm_head_quant is not None
    off = LLM(path, quant_kernels=False, **engine)
    assert [o.token_ids for o in off.generate(PROMPTS, params)] == \
        [o.token_ids for o in float_x.generate(PROMPTS, params)]
    plain = LLM(path, **engine)
    assert plain.engine.model.lm_head_quant.int8_activations
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    drafter = save_tiny_drafter(resolve_model_dir(path), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 6), ("ddtree", 20)):
        llm = LLM(path, spec=spec, draft=str(drafter), budget=budget, **engine)
        assert llm.engine.model.lm_head_quant is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, (spec, budget)
    made = use_copying_proposer(monkeypatch, depth=3)
    llm = LLM(path, spec="dflash", draft=str(drafter), **engine)
    made[-1].attach(llm.engine)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert max(n for o in outs for n in o.acceptance_lengths) == 4  # whole blocks accepted: 4-row products


LONG_PROMPTS = [list(range(3, 60)), [1, 5, 7], [(7 * i) % 90 + 3 for i in range(45)], [9, 9, 9, 4] * 10]


@needs_kernel
@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen2", False)])
def test_wide_forwards_read_the_blocks_and_stay_exact(tmp_path, model_type, tied):
    """Forwards of more than 32 tokens (prompt chunks of 48 tokens, 4 rows of trees of 41 nodes: 164
    tokens, past the C++ attention's 32 per row too) compute from the blocks like any other, and no fp32
    weights are kept: DFlash and DDTree stay token-identical to plain decoding, and each prompt alone
    gets the tokens it gets in the batch."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf", model_type, tied))
    engine = dict(device="cpu", max_running=4, max_context=160, prefill_chunk=48, **FIXED_NODES)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(path, **engine)
    model = plain.engine.model
    assert model.lm_head.weight.numel() == 0 and model.model.layers[0].mlp.gate_up.numel() == 0
    expected = [o.token_ids for o in plain.generate(LONG_PROMPTS, params)]
    assert [plain.generate([p], params)[0].token_ids for p in LONG_PROMPTS] == expected
    drafter = save_tiny_drafter(resolve_model_dir(path), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 12), ("ddtree", 40)):
        llm = LLM(path, spec=spec, draft=str(drafter), budget=budget, **engine)
        assert llm.engine.model.lm_head.weight.numel() == 0
        assert [o.token_ids for o in llm.generate(LONG_PROMPTS, params)] == expected, (spec, budget)


@pytest.fixture(scope="module")
def smollm2_pair():
    torch.set_num_threads(2)
    base = dict(device="cpu", dtype="float32", max_running=2, max_context=256)
    return LLM("smollm2", int8_activations=False, **base), LLM("smollm2", quant_kernels=False, **base)


@needs_kernel
@pytest.mark.slow
def test_smollm2_kernel_same_greedy_tokens(smollm2_pair):
    on, off = smollm2_pair
    found = holders(on.engine.model)
    assert all(h is not None for h in found) and len(found) == 1 + 4 * on.engine.model.config.num_hidden_layers
    assert on.engine.model.lm_head_quant.type_name == "Q8_0"
    assert {h.type_name for h in found[1:]} == {"Q4_1"}
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a Python function that reverses a string."}]]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for chat in chats:  # one at a time (1-row products) and both together (2-row products)
        assert on.chat(chat, params)[0].token_ids == off.chat(chat, params)[0].token_ids
    assert [o.token_ids for o in on.chat(chats, params)] == [o.token_ids for o in off.chat(chats, params)]
