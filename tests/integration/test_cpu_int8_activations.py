"""Int8 activations in the engine (the default for GGUF targets on the CPU): speculation stays
token-identical to plain decoding and a prompt's tokens do not depend on its batch, on tiny GGUFs of
each family and block type, and a verification forward of any width computes a node as the plain step
does, bit for bit; and on a real layer (SmolLM2's) the products stay within the error bound
of rounding x to int8 blocks. The kernel's own arithmetic: tests/unit/test_cpu_int8_activations.py."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.cpu.quant_linear import QuantizedLinear
from flashtree.models.loader import resolve_model_dir
from tests.dflash_helpers import save_tiny_drafter
from tests.helpers import root_of_tree_and_plain_step
from tests.support.checkpoints import QT, holders, isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)

AVAILABLE, WHY = kernels_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU kernel library unavailable: {WHY}")
UNIT_ROUNDOFF = 2.0 ** -24  # float32

PROMPTS = [list(range(3, 50)), [1, 5, 7], [9, 9, 9, 4] * 5]  # 47 tokens: a prompt chunk past the stack's 32


@pytest.mark.parametrize("model_type,layer_type", [("llama", QT.Q4_0), ("qwen2", QT.Q8_0), ("qwen3", QT.Q4_1)])
def test_speculation_and_batches_keep_plain_tokens(tmp_path, model_type, layer_type):
    """With int8 activations: DFlash and DDTree (trees of up to 6 and 20 nodes) give plain decoding's
    tokens, and each prompt decoded alone gets the tokens it gets in the batch of 3."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf", model_type, layer_type=layer_type))
    engine = {"device": "cpu", "max_running": 3, "max_context": 128, "prefill_chunk": 40, "adaptive_spec": False}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(path, **engine)
    found = holders(plain.engine.model)
    assert all(h is not None and h.int8_activations for h in found)
    assert {h.type_name for h in found[1:]} == {layer_type.name}
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [plain.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    drafter = save_tiny_drafter(resolve_model_dir(path), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 6), ("ddtree", 20)):
        llm = LLM(path, spec=spec, draft=str(drafter), budget=budget, **engine)
        assert llm.engine.model.lm_head_quant.int8_activations
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, (spec, budget)


@pytest.mark.parametrize("layer_stack", [True, False])
def test_a_verify_forward_computes_its_root_as_the_plain_step_does(tmp_path, layer_stack):
    """The root of a verification forward gets the plain decode step's logits bit for bit, at 8 nodes and at
    40 (past the 32-token limit of prompt chunks, where SDPA's blocked kernel once served trees: its sums in
    another order moved the o product's input by an ulp, which the int8 rounding of x can turn into a whole
    step; a DDTree-64 round on SmolLM2 then differed from plain decoding)."""
    model = LLM(str(tiny_gguf(tmp_path / "tiny.gguf", "qwen3")), device="cpu", max_context=128).engine.model
    assert all(h.int8_activations for h in holders(model)) and model.use_layer_stack(layer_stack) == layer_stack
    gen = torch.Generator().manual_seed(0)
    for nodes in (8, 40):
        root, step = root_of_tree_and_plain_step(model, nodes, 23, 64, gen)
        assert torch.equal(root, step), nodes


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def error_bounds(x: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For y = x @ W.T computed with x rounded to int8 blocks and with float x, per (row, column) [M, N]:
    - the worst case: each x moves by at most d / 2 (d = max|x| / 127 of its block; plus 4 unit roundoffs
      of max|x| for the rounding of x / d), so |y_int8 - y_float| <= sum_i (d_i / 2 + 4 u max|x|) |w_i|,
      plus float32 rounding of both sums: at most (K / 16 + 2 K / 32 + 12) u sum |x_i| |w_i| (the float
      path's chains of K / 16 fmas at most, the int8 path's of 2 K / 32, lane sums, products, bias);
    - the expected square: the rounding errors of x spread uniformly over [-d / 2, d / 2] and
      independently, E[(y_int8 - y_float)^2] = sum_i d_i^2 / 12 w_i^2."""
    blocks = x.double().reshape(x.shape[0], -1, 32)  # [M, B, 32]
    d = blocks.abs().amax(-1, keepdim=True) / 127  # [M, B, 1]
    step = (d / 2 + 4 * UNIT_ROUNDOFF * 127 * d).expand_as(blocks).reshape(x.shape)  # [M, K]
    w = dense.double()
    k = x.shape[1]
    rounding = (k / 16 + 2 * k / 32 + 12) * UNIT_ROUNDOFF * ((x.double().abs() + step) @ w.abs().T)
    worst = step @ w.abs().T + rounding
    expected_square = (d.expand_as(blocks).reshape(x.shape) ** 2 / 12) @ (w ** 2).T
    return worst, expected_square


@pytest.fixture(scope="module")
def smollm2_model():
    return LLM("smollm2", device="cpu", max_running=1, max_context=64).engine.model


def test_int8_error_on_a_real_layer_is_within_its_bound(smollm2_model):
    """SmolLM2's first layer (Q4_1 qkv, gate-up and down) and its Q8_0 lm_head, on inputs made from its own
    token embeddings (the first layer's normed input; the MLP's inputs are those rows through gate-up and
    silu): every entry within the worst-case bound, and the mean square error within [1/4, 2] of the
    uniform-rounding expectation (over thousands of entries; it would be 4x for a rounding twice as coarse,
    and about 0 if x were not rounded)."""
    model = smollm2_model
    layer = model.model.layers[0]
    ids = torch.arange(0, 49152, 49152 // 24)[:24]
    embedded = model.embed_quant.dequantize(ids)  # [24, 576]
    eps = model.config.rms_norm_eps
    normed = rms_normed(embedded, layer.input_layernorm.weight, eps)
    gate, up = QuantizedLinear("Q4_1", layer.mlp.gate_up_quant.blocks, 576)(normed).chunk(2, dim=-1)
    activated = torch.nn.functional.silu(gate) * up  # [24, 1536]: the down product's input
    head_input = rms_normed(embedded, model.model.norm.weight, eps)
    for name, holder, x in (("qkv", layer.self_attn.qkv_quant, normed), ("gate_up", layer.mlp.gate_up_quant, normed),
                            ("down", layer.mlp.down_quant, activated), ("lm_head", model.lm_head_quant, head_input)):
        dense = holder.dequantize()  # [N, K]
        as_float = QuantizedLinear(holder.type_name, holder.blocks, holder.in_features)(x).double()
        as_int8 = QuantizedLinear(holder.type_name, holder.blocks, holder.in_features, int8_activations=True)(x)
        error = as_int8.double() - as_float
        worst, expected_square = error_bounds(x, dense)
        assert (error.abs() <= worst).all(), (name, (error.abs() / worst).max().item())
        ratio = (error ** 2).sum() / expected_square.sum()
        assert 0.25 <= ratio <= 2.0, (name, ratio.item())
