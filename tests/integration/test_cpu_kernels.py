"""The lossless contract with the fused C++ kernels on (they are on by default in CPU fp32 engines);
their numerics against the torch ops are in tests/unit/test_cpu_kernels.py."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu import fused as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernel library does not build here")


def test_engines_use_them_and_stay_lossless(tmp_path):
    """DDTree greedy equals plain greedy with the kernels on (batch 3, rows of different lengths),
    and the same run without them gives the same tokens here."""
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    prompts = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for spec, kernels in (("none", True), ("ddtree", True), ("ddtree", False)):
        llm = LLM(str(pair.target), spec=spec, draft=None if spec == "none" else str(pair.drafter), budget=6,
                  device="cpu", cpu_kernels=kernels, adaptive_spec=False, max_running=4, max_context=64)
        assert llm.engine.model.fused_kernels == kernels
        if spec != "none":
            assert llm.engine.proposer.runner.drafter.fused_kernels == kernels
        runs[spec, kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["ddtree", True] == runs["none", True]
    assert runs["ddtree", True] == runs["ddtree", False]


def test_a_dense_engine_holds_its_products_and_stays_lossless_on_wide_trees(tmp_path):
    """A dense float32 target (no GGUF blocks): the engine runs every product through the block kernel over the
    float32 weights (the layer stack too), so DDTree rounds of 40 nodes (past the kernel attention's 32-token
    prompt chunks) give plain decoding's tokens; with --no-quant-kernels the products are F.linear's."""
    from flashtree.kernels.cpu.quant_linear import Float32Rows
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=64, block_size=9, drafter_layers=1, tokenizer=False)
    prompts = [list(range(3, 45)), [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]]  # 42 tokens: a chunk past 32
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = {"device": "cpu", "adaptive_spec": False, "max_running": 4, "max_context": 128}
    plain = LLM(str(pair.target), **engine)
    model = plain.engine.model
    assert isinstance(model.lm_head_quant, Float32Rows) and model.layer_stack is not None
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    tree = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=40, **engine)
    assert [o.token_ids for o in tree.generate(prompts, params)] == expected
    assert LLM(str(pair.target), quant_kernels=False, **engine).engine.model.lm_head_quant is None
