"""A Q4_K_M-mix GGUF (Q4_K, with Q6_K for attn_v, ffn_down and output) on the CPU runs from its blocks:
the loader keeps every matrix as blocks (the fused q/k/v as a mixed Q4_K + Q6_K product) and no float32
copies, the layer stack takes the new type codes, speculative decoding with the kernel equals plain
decoding with it (int8 activations, the default, and float activations), and with float activations the
tokens equal those of the float32 weights (quant_kernels=False)."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.cpu.quant_linear import MixedQuantizedLinear
from flashtree.models.loader import resolve_model_dir
from tests.dflash_helpers import save_tiny_drafter
from tests.support.checkpoints import holders, isolated_cache  # noqa: F401 (autouse fixture)
from tests.support.kquants import q4_k_m_gguf

AVAILABLE, WHY = kernels_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU block kernel unavailable: {WHY}")
PROMPTS = [[1, 5, 7], list(range(3, 20)), [9, 9, 9, 4], [30, 2, 60, 61, 62]]


def test_q4_k_m_runs_from_blocks_and_stays_exact(tmp_path):
    path = str(q4_k_m_gguf(tmp_path / "tiny-q4_k_m.gguf"))
    engine = {"device": "cpu", "max_running": 4, "max_context": 96, "prefill_chunk": 8, "adaptive_spec": False}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(path, **engine)
    model = plain.engine.model
    held = holders(model)
    assert None not in held and model.embed_quant is not None and model.layer_stack is not None
    assert held[0].type_name == "Q6_K"  # the lm_head
    for i in range(model.config.num_hidden_layers):
        qkv, o, gate_up, down = held[1 + 4 * i:5 + 4 * i]
        assert isinstance(qkv, MixedQuantizedLinear) and [p.type_name for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
        assert (o.type_name, gate_up.type_name, down.type_name) == ("Q4_K", "Q4_K", "Q6_K")
    matrices = {n: p for n, p in model.named_parameters() if n.endswith(("proj.weight", "lm_head.weight",
                                                                        "embed_tokens.weight"))}
    assert len(matrices) == 2 + 7 * model.config.num_hidden_layers
    assert all(p.numel() == 0 for p in matrices.values())  # no float32 copy of any matrix
    assert model.model.layers[0].self_attn.qkv_weight.numel() == 0

    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert len({tuple(t) for t in expected}) == len(PROMPTS)
    assert [plain.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    drafter = save_tiny_drafter(resolve_model_dir(path), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 6), ("ddtree", 20)):
        llm = LLM(path, spec=spec, draft=str(drafter), budget=budget, **engine)
        assert llm.engine.model.layer_stack is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, (spec, budget)

    float_x = LLM(path, int8_activations=False, **engine)
    assert float_x.engine.model.layer_stack is not None
    float_tokens = [o.token_ids for o in float_x.generate(PROMPTS, params)]
    off = LLM(path, quant_kernels=False, **engine)
    assert off.engine.model.lm_head_quant is None
    assert [o.token_ids for o in off.generate(PROMPTS, params)] == float_tokens
    ddtree = LLM(path, spec="ddtree", draft=str(drafter), budget=12, int8_activations=False, **engine)
    assert [o.token_ids for o in ddtree.generate(PROMPTS, params)] == float_tokens
