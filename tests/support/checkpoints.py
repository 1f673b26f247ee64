"""Tiny random checkpoints for the loader tests and the CPU kernel tests: Hugging Face configs and
models of each supported family, a word-level tokenizer, and GGUF files written as llama.cpp writes
them (quantized, Llama q/k rows permuted); with the fixtures that isolate the conversion cache
(per test, or per module)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

QT = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Every test gets its own conversion cache and never reaches the network."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path / "flashtree-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory):
    """Conversions of the tiny GGUFs (and the kernel build) go to a private cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHTREE_CACHE", str(tmp_path_factory.mktemp("flashtree-cache")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


# ----------------------------------------------------------------------------- tiny models

def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A few-KB config of each supported family; hidden/intermediate are multiples of 32
    so every row splits into whole GGUF quantization blocks."""
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    common.update(overrides)
    if model_type == "llama":
        return transformers.LlamaConfig(**common)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(head_dim=32, **common)  # head_dim != hidden / heads


def head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tiny_model(model_type: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny causal LM whose every parameter (norms and biases too) is random."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "flash", "tree"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    return tokenizer


def state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    weights = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


# ----------------------------------------------------------------------------- GGUF writing

_GGUF_BLOCK_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBALS:
        return f"{_GGUF_GLOBALS[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_BLOCK_PARTS[part]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (weights and biases)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_tiny_gguf(
    path: Path, model: transformers.PreTrainedModel, qtype: QT, *, arch: str | None = None,
    raw_overrides: dict[str, tuple[np.ndarray, QT]] | None = None, extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; returns gguf name -> what a reader dequantizes."""
    config = model.config
    arch = arch or config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    written = {}
    for hf_name, tensor in state_dict(model).items():
        name = gguf_name(hf_name)
        array = tensor.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        array_type = QT.F32 if array.ndim == 1 else qtype  # llama.cpp keeps norms and biases in F32
        if raw_overrides and name in raw_overrides:
            data, array_type = raw_overrides[name]
        else:
            data = gguf.quants.quantize(array, array_type)
        writer.add_tensor(name, data, raw_dtype=array_type if data.dtype == np.uint8 else None)
        written[name] = gguf.quants.dequantize(data, array_type)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
        written[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


# ----------------------------------------------------------------------------- GGUF models for the CPU kernel

def decisive_weights(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``model`` with weights less flat than N(0, 1) everywhere, for meaningful argmax decisions:
    matrices N(0, 0.2), biases N(0, 0.1), norms 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "norm" not in name:
                p.normal_(0, 0.1)
            else:
                p.fill_(1.0)
    return model


def tiny_gguf(path, model_type="llama", tied=True, seed=0, layer_type=QT.Q4_1):
    """A tiny model as llama.cpp writes it: Q4_1 layers (or ``layer_type``), the (tied) embedding Q8_0."""
    model = decisive_weights(tiny_model(model_type, seed=seed, tie_word_embeddings=tied, num_hidden_layers=3))
    embedding = model.model.embed_tokens.weight.detach().float().numpy()
    overrides = {"token_embd.weight": (gguf.quants.quantize(embedding, QT.Q8_0), QT.Q8_0)}
    write_tiny_gguf(path, model, layer_type, raw_overrides=overrides)
    return path


def holders(model) -> list:
    """The quantized-block holders of a built model: the lm_head's, then per layer qkv, o, gate_up, down."""
    found = [model.lm_head_quant]
    for layer in model.model.layers:
        found += [layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant, layer.mlp.down_quant]
    return found
