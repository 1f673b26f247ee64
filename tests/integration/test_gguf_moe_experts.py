"""A Qwen3-MoE GGUF's experts stay in the GGUF (models/gguf_experts.py): the conversion writes none of
them, the loader decodes one when it is read, and on the CPU in float32 experts of Q4_0 / Q4_1 / Q8_0
compute from their blocks with no float32 copy, giving the tokens the float32 experts give, in plain
and speculative decoding."""

from __future__ import annotations

import os

import gguf
import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.errors import CheckpointError
from flashtree.kernels.cpu.library import kernels_available
from flashtree.models import gguf_experts
from flashtree.models.gguf_convert import convert_gguf
from flashtree.models.loader import load_checkpoint, resolve_model_dir
from flashtree.models.safetensors_reads import SafetensorsFile
from tests.dflash_helpers import save_tiny_drafter
from tests.integration.test_gguf_moe import PROMPTS, tiny_moe, write_moe_gguf
from tests.support.checkpoints import isolated_caches  # noqa: F401 (autouse fixture)

QT = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not kernels_available()[0], reason="CPU block kernel unavailable")
EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{part}.weight"


@pytest.fixture(scope="module")
def hf_model():
    return tiny_moe(seed=1)


def test_the_conversion_keeps_no_expert_and_the_loader_decodes_one_when_read(tmp_path, hf_model, monkeypatch):
    written = write_moe_gguf(tmp_path / "moe.gguf", hf_model, QT.Q8_0)
    converted = SafetensorsFile(convert_gguf(tmp_path / "moe.gguf") / "model.safetensors")
    assert not any(".experts." in name for name in converted.entries)
    decoded = []
    monkeypatch.setattr(gguf_experts.ExpertMatrix, "dequantized", lambda self, real=gguf_experts.ExpertMatrix.dequantized:
                        decoded.append(self) or real(self))
    weights = load_checkpoint(str(tmp_path / "moe.gguf")).weights
    names = list(weights)
    assert EXPERT.format(layer=2, expert=5, part="down_proj") in names and not decoded  # listing decodes nothing
    got = weights[EXPERT.format(layer=2, expert=5, part="down_proj")]
    assert len(decoded) == 1 and torch.equal(got, torch.from_numpy(written["blk.2.ffn_down_exps.weight"][5]))


def test_a_changed_gguf_is_named(tmp_path, hf_model):
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, hf_model, QT.Q8_0)
    load_checkpoint(str(path))
    os.utime(path, ns=(1, 1))  # another file now (the cache key changes too: convert again)
    directory = resolve_model_dir(str(path))
    os.utime(path, ns=(2, 2))
    with pytest.raises(CheckpointError, match=r"experts are read from .*moe\.gguf, which is gone or changed"):
        from flashtree.models.loader import load_model_dir
        load_model_dir(directory)


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_cpu_experts_compute_from_their_blocks(tmp_path, hf_model, qtype):
    """Every expert holds its blocks (its float32 weights empty; the blocks decode to the GGUF's values);
    with float32 activations the model's tokens equal those of float32 experts (quant_kernels=False),
    and with int8 activations (the default) DFlash and DDTree give plain decoding's tokens."""
    path = tmp_path / "moe.gguf"
    written = write_moe_gguf(path, hf_model, qtype)
    engine = dict(device="cpu", max_running=3, max_context=96, adaptive_spec=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), **engine)
    moe = llm.engine.model.model.layers[2].mlp
    for e, expert in enumerate(moe.experts):
        assert expert.gate_proj.weight.numel() == 0 and expert.down_proj.weight.numel() == 0
        assert torch.equal(expert.down_quant.dequantize(), torch.from_numpy(written["blk.2.ffn_down_exps.weight"][e]))
        gate_up = torch.cat([torch.from_numpy(written[f"blk.2.ffn_{p}_exps.weight"][e]) for p in ("gate", "up")])
        assert torch.equal(expert.gate_up_quant.dequantize(), gate_up)
    fp32 = [o.token_ids for o in LLM(str(path), quant_kernels=False, **engine).generate(PROMPTS, params)]
    assert [o.token_ids for o in LLM(str(path), int8_activations=False, **engine).generate(PROMPTS, params)] == fp32
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    drafter = save_tiny_drafter(resolve_model_dir(str(path)), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 8)):
        tree = LLM(str(path), spec=spec, draft=str(drafter), budget=budget, **engine)
        assert [o.token_ids for o in tree.generate(PROMPTS, params)] == expected, spec


@needs_kernel
@pytest.mark.parametrize("int8", [True, False])
def test_the_one_call_moe_layer_is_the_per_expert_path_bit_for_bit(tmp_path, hf_model, int8):
    """On GGUF experts the CPU kernels run a MoE layer (router and routed experts) in one C++ call
    (``cpu_fused.moe_layer``): bit-identical to the per-expert path (``SparseMoE.reference``) for one
    row, a few and a tree's worth, and each row's result is the one it gets alone."""
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, hf_model, QT.Q4_0)
    llm = LLM(str(path), device="cpu", max_running=2, max_context=64, int8_activations=int8)
    moe = llm.engine.model.model.layers[2].mlp
    assert moe.kernel_table() is not None
    x = torch.randn(17, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    for rows in (1, 5, 17):
        assert torch.equal(moe(x[:rows]), moe.reference(x[:rows]))
    alone = torch.cat([moe(x[i:i + 1]) for i in range(17)])
    assert torch.equal(moe(x), alone)


@needs_kernel
def test_the_layer_stack_runs_moe_layers_with_the_per_op_paths_tokens(tmp_path, hf_model):
    """The C++ layer stack takes a MoE GGUF (its MoE layers through the same router and expert call as
    the per-op path): the tokens of plain and DDTree decoding equal the per-op path's."""
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, hf_model, QT.Q4_0)
    engine = dict(device="cpu", max_running=3, max_context=96, adaptive_spec=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    stacked = LLM(str(path), **engine)
    assert stacked.engine.model.layer_stack is not None
    per_op = LLM(str(path), cpu_layer_stack=False, **engine)
    assert per_op.engine.model.layer_stack is None
    expected = [o.token_ids for o in per_op.generate(PROMPTS, params)]
    assert [o.token_ids for o in stacked.generate(PROMPTS, params)] == expected
    drafter = save_tiny_drafter(resolve_model_dir(str(path)), tmp_path / "drafter", block_size=4)
    tree = LLM(str(path), spec="ddtree", draft=str(drafter), budget=8, **engine)
    assert tree.engine.model.layer_stack is not None
    assert [o.token_ids for o in tree.generate(PROMPTS, params)] == expected
