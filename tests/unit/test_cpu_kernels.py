"""The fused C++ kernels (models/cpu_kernels.py) against the torch ops they replace, on the same
tiny models and drafter as tests/test_gpu_kernels.py, and the lossless contract with them on
(they are on by default in CPU fp32 engines)."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu import fused as cpu_kernels
from flashtree.kernels.cpu import library as cpu_library
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


def test_tree_attention_node_equals_its_plain_decode_step():
    """A tree node's attention output is bit-identical to the one-query call that plain decoding makes
    once the node's ancestors are committed: the same keys in the same order, whatever else shares
    the call (the kernel's key-major loops must keep every query's sums in key order)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, committed = 6, 2, 48, 37
    parents = [-1, 0, 0, 1, 2, 3, 1, 5]  # node 0 is the root; the rest are drafted nodes
    nodes = len(parents)
    mask = torch.zeros(1, nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    k_cache, v_cache = torch.randn(2, 2, kv_heads, 64, head_dim).unbind(0)  # [slots, KVH, entries, D] each
    q = torch.randn(1, heads, nodes, head_dim)
    tree = cpu_kernels.tree_attention(q, k_cache, v_cache, torch.tensor([0]), torch.tensor([committed]), mask)
    for i in range(nodes):
        path = torch.nonzero(mask[0, i]).flatten()  # the node's ancestors and itself, root first
        plain_k, plain_v = k_cache.clone(), v_cache.clone()
        plain_k[1, :, :committed], plain_v[1, :, :committed] = k_cache[0, :, :committed], v_cache[0, :, :committed]
        plain_k[1, :, committed:committed + len(path)] = k_cache[0, :, committed + path]
        plain_v[1, :, committed:committed + len(path)] = v_cache[0, :, committed + path]
        length = committed + len(path) - 1  # everything before the node is committed
        step = cpu_kernels.tree_attention(q[:, :, i:i + 1].contiguous(), plain_k, plain_v, torch.tensor([1]),
                                          torch.tensor([length]), torch.ones(1, 1, 1, dtype=torch.bool))
        assert torch.equal(step[:, :, 0], tree[:, :, i]), f"node {i}"


@pytest.mark.skipif("avx2" not in cpu_library.cpu_flags(), reason="needs an AVX2 CPU")
def test_avx2_build_of_the_fused_ops(monkeypatch):
    """The AVX2 build's silu, attention and the other fused ops (its own vector exp), also on a CPU
    that would take the AVX-512 one, against the torch ops and the tree-node identity above."""
    quant = cpu_library
    monkeypatch.setattr(quant, "cpu_flags", lambda: {"avx2", "f16c", "fma"})
    quant.load_kernels.cache_clear()
    try:
        gate_up = torch.randn(5, 2 * 200) * 6  # wide range: exp's clamps and both tails of silu
        expected = torch.nn.functional.silu(gate_up[:, :200]) * gate_up[:, 200:]
        torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-5)
        _check(compare("cpu", torch.float32, backend="cpu") | compare_attention("cpu", torch.float32, backend="cpu"), 1e-4)
        test_tree_attention_node_equals_its_plain_decode_step()
    finally:
        quant.load_kernels.cache_clear()
