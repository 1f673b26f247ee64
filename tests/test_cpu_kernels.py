"""The fused C++ kernels (models/cpu_kernels.py) against the torch ops they replace, on the same
tiny models and drafter as tests/test_gpu_kernels.py, and the lossless contract with them on
(they are on by default in CPU fp32 engines)."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models import cpu_kernels
from tests.test_gpu_kernels import _check, compare, compare_attention, compare_drafter

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernel library does not build here")


def test_cpu_kernels_match_torch_ops(tmp_path):
    diffs = compare("cpu", torch.float32, backend="cpu") | compare_drafter("cpu", torch.float32, str(tmp_path), "cpu")
    _check(diffs | compare_attention("cpu", torch.float32, backend="cpu"), 1e-4)


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
