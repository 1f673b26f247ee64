"""The embedded SmolLM2 checkpoint (the real GGUF file): its config and tokenizer, the conversion
cache on a second load, and the weights against transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from flashtree.models import loader
from flashtree.models.embedded import EMBEDDED_MODELS, embedded_gguf_path
from flashtree.models.loader import Checkpoint, load_checkpoint
from tests.support.checkpoints import isolated_caches, llama_cpp_permute  # noqa: F401 (autouse fixture)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    """One conversion cache for every SmolLM2 test of the session."""
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture
def smollm2(smollm2_cache, monkeypatch) -> Checkpoint:
    monkeypatch.setenv("FLASHTREE_CACHE", str(smollm2_cache))
    return load_checkpoint("smollm2")


def test_smollm2_config_and_tokenizer(smollm2):
    config = smollm2.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and "lm_head.weight" not in smollm2.weights
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 100000.0
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert smollm2.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert {t.dtype for t in smollm2.weights.values()} == {torch.float32}
    tokenizer = smollm2.tokenizer
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_second_load_is_cached(smollm2, smollm2_cache, monkeypatch):
    monkeypatch.setenv("FLASHTREE_CACHE", str(smollm2_cache))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("SmolLM2 was converted twice"))
    again = load_checkpoint("smollm2")  # (GGUFReader fails the test if the file is converted again)
    assert again.path == smollm2.path and again.path.parent == smollm2_cache / "gguf"
    assert torch.equal(again.weights["model.layers.7.mlp.up_proj.weight"],
                       smollm2.weights["model.layers.7.mlp.up_proj.weight"])


def test_smollm2_matches_transformers_gguf_loader(smollm2):
    """transformers dequantizes and un-permutes the same file independently."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_gguf_path(EMBEDDED_MODELS["smollm2"])
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    with torch.device("meta"):  # only its parameter names are needed
        names_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**parsed["config"]))
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_model)["tensors"]
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.29.mlp.down_proj.weight"] + [
        f"model.layers.{layer}.self_attn.{p}_proj.weight" for layer in (0, 15) for p in "qkvo"]
    for name in names:
        assert (smollm2.weights[name] - reference[name].float()).abs().max().item() < 1e-6, name
    q_proj = smollm2.weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(llama_cpp_permute(q_proj, 9) - q_proj).max() > 0.1  # the permutation mattered
