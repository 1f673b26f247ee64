"""The fused C++ kernels (flashtree/kernels/cpu) against the torch ops they replace, on the same
tiny models and drafter as the Triton kernels' checks (tests/support/kernel_checks.py); the
lossless contract with them on is in tests/integration/test_cpu_kernels.py."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels.cpu import fused as cpu_kernels
from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu.quant_linear import Float32Rows
from tests.helpers import ours_from_hf, root_of_tree_and_plain_step, tiny_hf_model
from tests.support.kernel_checks import (
    _check,
    compare,
    compare_attention,
    compare_drafter,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernel library does not build here")


def test_cpu_kernels_match_torch_ops(tmp_path):
    diffs = compare("cpu", torch.float32, backend="cpu") | compare_drafter("cpu", torch.float32, str(tmp_path), "cpu")
    _check(diffs | compare_attention("cpu", torch.float32, backend="cpu"), 1e-4)


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
    table = torch.arange(2)[:, None]  # one page per slot
    tree = cpu_kernels.tree_attention(q, k_cache, v_cache, table, torch.tensor([0]), torch.tensor([committed]), mask)
    for i in range(nodes):
        path = torch.nonzero(mask[0, i]).flatten()  # the node's ancestors and itself, root first
        plain_k, plain_v = k_cache.clone(), v_cache.clone()
        plain_k[1, :, :committed], plain_v[1, :, :committed] = k_cache[0, :, :committed], v_cache[0, :, :committed]
        plain_k[1, :, committed:committed + len(path)] = k_cache[0, :, committed + path]
        plain_v[1, :, committed:committed + len(path)] = v_cache[0, :, committed + path]
        length = committed + len(path) - 1  # everything before the node is committed
        step = cpu_kernels.tree_attention(q[:, :, i:i + 1].contiguous(), plain_k, plain_v, table, torch.tensor([1]),
                                          torch.tensor([length]), torch.ones(1, 1, 1, dtype=torch.bool))
        assert torch.equal(step[:, :, 0], tree[:, :, i]), f"node {i}"


def test_a_dense_model_computes_a_tree_root_as_its_plain_step():
    """A dense float32 model with its products held by the block kernel over the float32 weights (F.linear's
    rows change bits with the row count): the root of a verification forward of 8 and of 40 nodes gets the
    plain decode step's logits bit for bit; released, the holders go."""
    model = ours_from_hf(tiny_hf_model("qwen2_bias"), device="cpu", dtype=torch.float32)
    assert model.use_cpu_kernels() and model.hold_float32_products()
    held = [model.lm_head_quant] + [h for layer in model.model.layers for h in (
        layer.self_attn.qkv_quant, layer.self_attn.o_quant, layer.mlp.gate_up_quant, layer.mlp.down_quant)]
    assert all(isinstance(h, Float32Rows) for h in held)
    gen = torch.Generator().manual_seed(0)
    for nodes in (8, 40):  # (a prompt of 41 tokens: a chunk past the kernel attention's 32)
        root, step = root_of_tree_and_plain_step(model, nodes, 41, 97, gen)
        assert torch.equal(root, step), nodes
    assert not model.hold_float32_products(False)
    assert model.lm_head_quant is None and model.model.layers[0].mlp.down_quant is None


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


def test_a_dense_moe_model_computes_a_tree_root_as_its_plain_step():
    """The same for a dense float32 Qwen3-MoE model: its experts' products held too (routed experts see as many
    rows as tokens chose them, so F.linear's row variance reached the root before), the layer in one C++ call."""
    model = ours_from_hf(tiny_hf_model("qwen3_moe", moe_intermediate_size=32), device="cpu", dtype=torch.float32)
    assert model.use_cpu_kernels() and model.hold_float32_products()
    moe = model.model.layers[0].mlp
    assert all(isinstance(h, Float32Rows) for e in moe.experts for h in (e.gate_up_quant, e.down_quant))
    assert moe.kernel_table() is not None
    gen = torch.Generator().manual_seed(0)
    for nodes in (8, 40, 100):
        root, step = root_of_tree_and_plain_step(model, nodes, 41, 97, gen)
        assert torch.equal(root, step), nodes
    assert not model.hold_float32_products(False)
    assert moe.experts[0].down_quant is None and moe.kernel_table() is None
