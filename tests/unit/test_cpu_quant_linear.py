"""CPU block kernel (flashtree/kernels/cpu/quant_linear.py): products from GGUF Q4_0 / Q4_1 / Q8_0
blocks equal ``x @ W.T`` with the converter's fp32 weights, and the rebuilt weights are
bit-identical. (The engine with the kernel returns the same greedy tokens as without it:
tests/integration/test_cpu_quant_linear.py.) Needs a C++ compiler and an AVX-512 or AVX2 CPU;
skipped with the reason otherwise."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from flashtree import LLM
from flashtree.config import EngineConfig
from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu import quant_linear
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.cpu.quant_linear import MAX_ROWS, QuantizedLinear
from flashtree.models import gguf_blocks as gguf_block_store
from flashtree.models.loader import resolve_model_dir
from tests.support.checkpoints import holders, isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)

AVAILABLE, WHY = kernels_available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"CPU block kernel unavailable: {WHY}")


def quantized(rows: int, cols: int, type_name: str, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    """Random weights quantized with the gguf package: the holder and numpy's dequantized fp32."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    dense = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(rows, cols)
    return QuantizedLinear(type_name, torch.from_numpy(np.array(data).reshape(rows, -1)), cols), torch.from_numpy(dense)


# ----------------------------------------------------------------------------- the kernel

@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(32, 32), (96, 576), (200, 1536), (1000, 64)])
def test_kernel_matches_dequantized_matmul(type_name, shape):
    holder, dense = quantized(*shape, type_name, seed=shape[0])
    assert torch.equal(holder.dequantize(), dense)  # rebuilt bit-identical to numpy's dequantization
    torch.manual_seed(0)
    bias = torch.randn(shape[0])
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(holder(x), x @ dense.T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(holder(x, bias), x @ dense.T + bias, rtol=1e-5, atol=1e-4)
        # a row's result does not depend on the rows it shares the call with
        assert torch.equal(holder(x)[-1], holder(x[-1:])[0])


@needs_kernel
def test_linear_dispatches_by_rows_and_keeps_shapes():
    holder, dense = quantized(64, 96, "Q4_1", seed=1)
    for shape in [(1, 1, 96), (2, 1, 96), (1, 4, 96), (2, 4, 96), (3, 5, 96), (40, 96)]:
        x = torch.randn(*shape)
        y = quant_linear.linear(x, dense, None, holder)
        assert y.shape == (*shape[:-1], 64)
        torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 4, 96)[:, ::2]  # non-contiguous input
    torch.testing.assert_close(quant_linear.linear(x, dense, None, holder), x @ dense.T, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_fused_rows_concatenate_blocks():
    a, dense_a = quantized(32, 64, "Q4_1", seed=2)
    b, dense_b = quantized(64, 64, "Q4_1", seed=3)
    fused = QuantizedLinear.concat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([dense_a, dense_b]))


# ----------------------------------------------------------------------------- tiny GGUF models

@needs_kernel
@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen2", False)])
def test_gguf_model_gets_bit_identical_blocks(tmp_path, model_type, tied):
    """Every linear (fused qkv / gate_up, llama's un-permuted q/k, the lm_head) gets its blocks,
    and they rebuild exactly the fp32 weights the converter wrote."""
    llm = LLM(str(tiny_gguf(tmp_path / "tiny.gguf", model_type, tied)), device="cpu", max_running=2, max_context=64)
    model = llm.engine.model
    found = holders(model)
    assert all(h is not None for h in found)
    assert model.lm_head_quant.type_name == ("Q8_0" if tied else "Q4_1")
    assert torch.equal(model.lm_head_quant.dequantize(), model.lm_head.weight)
    for layer in model.model.layers:
        assert torch.equal(layer.self_attn.qkv_quant.dequantize(), layer.self_attn.qkv_weight)
        assert torch.equal(layer.mlp.gate_up_quant.dequantize(), layer.mlp.gate_up)
        assert torch.equal(layer.mlp.down_quant.dequantize(), layer.mlp.down_proj.weight)


@needs_kernel
def test_blocks_are_cached_beside_the_conversion(tmp_path):
    """The conversion keeps the blocks (gguf_blocks.safetensors); an older cache entry without
    them gets them from the GGUF on the next load."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    blocks_file = resolve_model_dir(path) / gguf_block_store.BLOCKS_FILE
    assert blocks_file.is_file()
    first = LLM(path, device="cpu", max_running=1, max_context=64)
    blocks_file.unlink()
    second = LLM(path, device="cpu", max_running=1, max_context=64)
    assert blocks_file.is_file()
    for a, b in zip(holders(first.engine.model), holders(second.engine.model)):
        assert b is not None and torch.equal(a.blocks, b.blocks)


@needs_kernel
def test_switch_off_and_fallback_log(tmp_path, monkeypatch, caplog):
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    off = LLM(path, device="cpu", max_running=1, max_context=64, quant_kernels=False)
    assert all(h is None for h in holders(off.engine.model))
    assert all(h is None for h in holders(LLM(path, device="cpu", max_context=64, dtype="bfloat16").engine.model))
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: {"sse4_2"})
    cpu_library.load_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="flashtree"):
            llm = LLM(path, device="cpu", max_running=1, max_context=64)
    finally:
        cpu_library.load_kernels.cache_clear()
    assert all(h is None for h in holders(llm.engine.model))
    assert [r.getMessage() for r in caplog.records if "quantized CPU kernels off" in r.getMessage()] == [
        "flashtree: quantized CPU kernels off, using the float32 weights: this CPU lacks avx2, f16c, fma "
        "(the kernel needs AVX-512 or AVX2 with F16C and FMA)"]


def test_instruction_set_is_the_best_the_cpu_has():
    pick = cpu_library.isa_compiler_flags
    assert pick({"avx512f", "avx512bw", "avx2", "f16c", "fma"}) == ("-mavx512f", "-mavx512bw")
    assert pick({"avx512f", "avx2", "f16c", "fma"}) == ("-mavx2",)  # no avx512bw: the AVX2 build
    assert pick({"avx2", "f16c", "fma", "sse4_2"}) == ("-mavx2",)
    with pytest.raises(cpu_library.KernelUnavailable, match="lacks f16c"):
        pick({"avx2", "fma"})


@needs_kernel
@pytest.mark.skipif("avx2" not in cpu_library.cpu_flags(), reason="needs an AVX2 CPU")
def test_avx2_build_matches_dequantized_matmul(monkeypatch):
    """The AVX2 build, also on a CPU that would take the AVX-512 one (where both then get tested)."""
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: {"avx2", "f16c", "fma"})
    cpu_library.load_kernels.cache_clear()
    try:
        test_kernel_matches_dequantized_matmul("Q4_1", (200, 1536))
        test_kernel_matches_dequantized_matmul("Q8_0", (96, 576))
        test_kernel_matches_dequantized_matmul("Q4_0", (1000, 64))
    finally:
        cpu_library.load_kernels.cache_clear()


def test_switch_reaches_the_engine_config():
    from flashtree.cli import build_parser
    from flashtree.cli.bench import setup_from_args
    from flashtree.cli.serve import config_from_args

    assert EngineConfig.of().kernels.quant_kernels is True
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).quant_kernels is True
    assert parser.parse_args(["generate", "--prompt", "x", "--no-quant-kernels"]).quant_kernels is False
    for flags, expected in (([], True), (["--no-quant-kernels"], False)):
        assert config_from_args(parser.parse_args(["serve", *flags])).engine.kernels.quant_kernels is expected
        bench = parser.parse_args(["bench", "--methods", "ar", "--dataset", "humaneval", *flags])
        assert setup_from_args(bench, needs_draft=False).engine.kernels.quant_kernels is expected
