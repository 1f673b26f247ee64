"""Decoding a GGUF in the k-quant types from the float32 dequantization of its matrices (the path of
every type the block kernel lacks): a Q4_K_M-like tiny model gives plain decoding's greedy tokens under
DFlash and DDTree, alone and in a batch; the embedded SmolLM2 requantized to Q4_K_M by llama.cpp (when
llama-cpp-python is installed; its 576-wide rows are not whole 256-weight super-blocks, so llama.cpp
writes most matrices as Q5_0 / Q5_1 instead) decodes with the shipped drafter token for token like plain
decoding. The same model through the block kernel: tests/integration/test_cpu_kquant_blocks.py."""

from __future__ import annotations

import ctypes
import importlib.util

import pytest

from flashtree import LLM, SamplingParams
from flashtree.models.loader import resolve_model_dir
from tests.dflash_helpers import save_tiny_drafter
from tests.support.checkpoints import isolated_cache  # noqa: F401 (autouse fixture)
from tests.support.kquants import q4_k_m_gguf

PROMPTS = [[1, 5, 7], list(range(3, 20)), [9, 9, 9, 4], [30, 2, 60, 61, 62]]


def test_q4_k_m_float32_products_speculation_equals_plain(tmp_path):
    path = q4_k_m_gguf(tmp_path / "tiny-q4_k_m.gguf")
    engine = dict(device="cpu", max_running=4, max_context=96, prefill_chunk=8, adaptive_spec=False,
                  quant_kernels=False)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), **engine)
    assert plain.engine.model.lm_head_quant is None
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # the prompts lead somewhere different
    assert [plain.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    drafter = save_tiny_drafter(resolve_model_dir(str(path)), tmp_path / "drafter", block_size=4)
    for spec, budget in (("dflash", None), ("ddtree", 6), ("ddtree", 20)):
        llm = LLM(str(path), spec=spec, draft=str(drafter), budget=budget, **engine)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, (spec, budget)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra)")
def test_smollm2_requantized_to_q4_k_m_decodes_losslessly(tmp_path):
    import llama_cpp

    from flashtree.models.embedded import EMBEDDED_MODELS, embedded_gguf_path
    from flashtree.speculative.defaults import SMOLLM2_DRAFTER

    out = tmp_path / "smollm2.q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, True
    assert llama_cpp.llama_model_quantize(str(embedded_gguf_path(EMBEDDED_MODELS["smollm2"])).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    engine = dict(device="cpu", max_running=2, max_context=192)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["def fibonacci(n):"]
    plain = LLM(str(out), **engine)
    expected = [o.token_ids for o in plain.generate(prompts, sampling)]
    tree = LLM(str(out), spec="ddtree", draft=str(SMOLLM2_DRAFTER), budget=16, adaptive_spec=False, **engine)
    assert [o.token_ids for o in tree.generate(prompts, sampling)] == expected
