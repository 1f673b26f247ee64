"""Qwen3-MoE GGUFs (llama.cpp's ``qwen3moe``: stacked experts ``blk.N.ffn_{gate,up,down}_exps``, the
router ``blk.N.ffn_gate_inp``) convert to the checkpoint a transformers save of the same weights is:
the config's routing, every expert's matrices, and the same tokens and logits (F32); a Q8_0 file
converts to its dequantized values, each expert of each layer in its place."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from flashtree import LLM, SamplingParams
from flashtree.models.gguf_convert import convert_gguf
from flashtree.models.loader import load_checkpoint
from flashtree.models.moe import per_expert_weights
from tests.support.checkpoints import gguf_name, isolated_caches  # noqa: F401 (autouse fixture)

QT = gguf.GGMLQuantizationType
DENSE_LAYER = 1  # mlp_only_layers: a dense MLP between MoE layers
PROMPTS = [[1, 5, 7, 9], list(range(3, 30)), [11] * 6]


def tiny_moe(seed: int = 0) -> transformers.PreTrainedModel:
    """Widths multiple of 32 (whole Q8_0 blocks); six experts, top-2, renormalized."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[DENSE_LAYER], max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() >= 2 else 0.1) + (1.0 if "norm" in name else 0.0))
    return model.eval()


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of ``model``: experts stacked [E, rows, columns] per projection."""
    out = {}
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        stem, _, kind = name.rpartition(".")
        if stem.endswith("mlp.experts"):  # transformers' in-memory layout: gate_up_proj [E, 2I, H], down_proj
            block = f"blk.{name.split('.')[2]}"
            if kind == "gate_up_proj":
                gate, up = np.split(array, 2, axis=1)
                out[f"{block}.ffn_gate_exps.weight"], out[f"{block}.ffn_up_exps.weight"] = gate, up
            else:
                out[f"{block}.ffn_down_exps.weight"] = array
        elif stem.endswith("mlp.gate"):
            out[f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"] = array
        else:
            out[gguf_name(name)] = array
    return out


def write_moe_gguf(path, model, qtype=QT.F32) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp's qwen3moe; returns gguf name -> what a reader dequantizes."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    written = {}
    for name, array in gguf_tensors(model).items():
        kind = QT.F32 if array.ndim == 1 or ".ffn_gate_inp." in name else qtype  # (llama.cpp keeps routers F32)
        data = gguf.quants.quantize(array, kind)
        writer.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
        written[name] = gguf.quants.dequantize(data, kind).reshape(array.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.fixture(scope="module")
def hf_model():
    return tiny_moe()


def test_the_config_carries_the_routing(tmp_path, hf_model):
    write_moe_gguf(tmp_path / "moe.gguf", hf_model)
    config = load_checkpoint(str(tmp_path / "moe.gguf")).config
    assert config.model_type == "qwen3_moe" and config.qk_norm
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (6, 2, 32)
    assert moe.norm_topk_prob and moe.mlp_only_layers == (DENSE_LAYER,)
    assert [moe.sparse(i) for i in range(3)] == [True, False, True]


def test_an_f32_gguf_decodes_as_the_safetensors_save_of_the_same_weights(tmp_path, hf_model):
    write_moe_gguf(tmp_path / "moe.gguf", hf_model)
    hf_model.save_pretrained(tmp_path / "hf")
    converted = load_checkpoint(str(tmp_path / "moe.gguf")).weights
    saved = per_expert_weights(load_checkpoint(str(tmp_path / "hf")).weights)
    assert sorted(converted) == sorted(saved)
    assert all(torch.equal(converted[name], saved[name].float()) for name in saved)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = {"device": "cpu", "dtype": "float32", "max_running": 4, "max_context": 96}
    from_gguf = LLM(str(tmp_path / "moe.gguf"), **engine)
    from_safetensors = LLM(str(tmp_path / "hf"), **engine)
    tokens = [o.token_ids for o in from_gguf.generate(PROMPTS, params)]
    assert tokens == [o.token_ids for o in from_safetensors.generate(PROMPTS, params)]
    with torch.no_grad():
        for prompt, row in zip(PROMPTS, tokens):
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert row == ref[0, len(prompt):].tolist()
    a, b = from_gguf.engine.model, from_safetensors.engine.model
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_q8_0_gguf_converts_to_its_dequantized_experts(tmp_path, hf_model):
    written = write_moe_gguf(tmp_path / "moe.gguf", hf_model, QT.Q8_0)
    converted = load_checkpoint(str(tmp_path / "moe.gguf")).weights
    for layer in (0, 2):
        router = converted[f"model.layers.{layer}.mlp.gate.weight"].numpy()
        assert np.array_equal(router, written[f"blk.{layer}.ffn_gate_inp.weight"])
        for part, hf_part in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            stacked = written[f"blk.{layer}.ffn_{part}_exps.weight"]
            for expert in range(6):
                got = converted[f"model.layers.{layer}.mlp.experts.{expert}.{hf_part}.weight"].numpy()
                assert np.array_equal(got, stacked[expert]), (layer, part, expert)
    assert f"model.layers.{DENSE_LAYER}.mlp.gate_proj.weight" in converted
    assert not any(name.startswith(f"model.layers.{DENSE_LAYER}.mlp.experts") for name in converted)
    gguf_dir = convert_gguf(tmp_path / "moe.gguf")
    llm = LLM(str(tmp_path / "moe.gguf"), device="cpu", dtype="float32", max_running=2, max_context=64)
    assert type(llm.engine.model.model.layers[0].mlp).__name__ == "SparseMoE"
    assert gguf_dir.is_dir() and len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids) == 6
