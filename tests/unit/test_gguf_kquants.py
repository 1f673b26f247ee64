"""GGUF files in the k-quant and codebook types (what Q4_K_M / Q5_K_M / Q6_K files people download
hold): the converter dequantizes every such matrix exactly as ggml defines it, un-permuted like the
legacy types. Decoding with them: tests/integration/test_gguf_kquant_decode.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import gguf
from flashtree.models.loader import load_checkpoint
from tests.support.checkpoints import gguf_name, isolated_caches, llama_cpp_permute, tiny_model  # noqa: F401
from tests.support.checkpoints import write_tiny_gguf
from tests.support.kquants import FP16_FIELDS, decode_q4_k, decode_q6_k, kquant_overrides, random_blocks

# rows of 256 and 512 weights: whole k-quant super-blocks everywhere
KQUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("qtype,decode", [(QT.Q4_K, decode_q4_k), (QT.Q6_K, decode_q6_k)], ids=["Q4_K", "Q6_K"])
def test_gguf_py_decodes_as_ggml_defines(qtype, decode):
    """gguf-py's decoder (the converter's) agrees bit for bit with a second reading of ggml's block
    layout (tests/support/kquants.py), on random blocks."""
    raw = random_blocks(6, 768, qtype, np.random.default_rng(1))
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, qtype), decode(raw, 768))


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda q: q.name)
def test_gguf_kquant_llama_dequantized_and_unpermuted(tmp_path, qtype):
    """Every matrix of a tiny Llama written in ``qtype`` loads as gguf-py's float32 decoding of its
    blocks, q/k rows un-permuted to Hugging Face's order."""
    model = tiny_model("llama", **KQUANT_SHAPE)
    written = write_tiny_gguf(tmp_path / "k.gguf", model, QT.F32, raw_overrides=kquant_overrides(model, {}, qtype))
    ckpt = load_checkpoint(str(tmp_path / "k.gguf"))
    heads = {"attn_q": 4, "attn_k": 2}
    for hf_name, tensor in ckpt.weights.items():
        name = gguf_name(hf_name)
        part = name.split(".")[-2]
        as_written = llama_cpp_permute(tensor.numpy(), heads[part]) if part in heads else tensor.numpy()
        np.testing.assert_array_equal(as_written, written[name], err_msg=hf_name)
        if tensor.dim() == 2:
            assert 0.05 < tensor.abs().max().item() <= 0.31 and torch.isfinite(tensor).all(), hf_name


def test_gguf_q4_k_m_mix_loads(tmp_path):
    """A Q4_K_M-like file (Q4_K, with Q6_K for attn_v, ffn_down and the output head) loads whole."""
    model = tiny_model("qwen2", **KQUANT_SHAPE)
    mix = {"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}
    written = write_tiny_gguf(tmp_path / "m.gguf", model, QT.F32, raw_overrides=kquant_overrides(model, mix, QT.Q4_K))
    ckpt = load_checkpoint(str(tmp_path / "m.gguf"))
    assert sorted(gguf_name(n) for n in ckpt.weights) == sorted(written)
    for hf_name, tensor in ckpt.weights.items():
        np.testing.assert_array_equal(tensor.numpy(), written[gguf_name(hf_name)], err_msg=hf_name)
