"""CPU block kernel (flashtree/kernels/cpu/quant_linear.py): products from GGUF Q4_0 / Q4_1 / Q8_0
blocks equal ``x @ W.T`` with the converter's fp32 weights, the rebuilt weights (and embedding rows)
are bit-identical, and a row's result is the same whatever the number of rows in the call. A GGUF
model holds its matrices as blocks only (models/quantized_weights.py: no fp32 copies; the fp32
weights back with quant_kernels=False or after detach_quantized). (The engine with the kernel returns
the same greedy tokens as without it: tests/integration/test_cpu_quant_linear.py.) Needs a C++
compiler and an AVX-512 or AVX2 CPU; skipped with the reason otherwise."""

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
from flashtree.kernels.cpu.quant_linear import Float32Rows, QuantizedLinear
from flashtree.models import gguf_blocks as gguf_block_store
from flashtree.models.loader import load_checkpoint, resolve_model_dir
from flashtree.models.quantized_weights import detach_quantized
from flashtree.models.safetensors_reads import SafetensorsFile
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
    for rows in range(1, 33):
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(holder(x), x @ dense.T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(holder(x, bias), x @ dense.T + bias, rtol=1e-5, atol=1e-4)
        # a row's result does not depend on the rows it shares the call with
        assert torch.equal(holder(x)[-1], holder(x[-1:])[0])


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(96, 576), (200, 1536), (70, 64)])
def test_many_rows_give_the_one_row_results(type_name, shape):
    """Products of more than 32 rows (prefill, wide trees; groups of 8 rows, or of 4 for wide rows) give,
    row for row, exactly what each row gives alone."""
    holder, dense = quantized(*shape, type_name, seed=shape[1])
    torch.manual_seed(1)
    bias = torch.randn(shape[0])
    for rows in (33, 100, 517):
        x = torch.randn(rows, shape[1])
        together = holder(x, bias)
        alone = torch.cat([holder(x[i:i + 1], bias) for i in range(rows)])
        assert torch.equal(together, alone)
        torch.testing.assert_close(together, x @ dense.T + bias, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_linear_reads_the_blocks_at_every_row_count_and_keeps_shapes():
    holder, dense = quantized(64, 96, "Q4_1", seed=1)
    for shape in [(1, 1, 96), (2, 1, 96), (1, 4, 96), (2, 4, 96), (3, 5, 96), (40, 96), (3, 50, 96)]:
        x = torch.randn(*shape)
        y = quant_linear.linear(x, torch.empty(0), None, holder)  # the fp32 weight is not read
        assert y.shape == (*shape[:-1], 64)
        assert torch.equal(y, holder(x))
        torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 4, 96)[:, ::2]  # non-contiguous input
    torch.testing.assert_close(quant_linear.linear(x, dense, None, holder), x @ dense.T, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_embedding_rows_from_blocks(type_name):
    holder, dense = quantized(300, 64, type_name, seed=4)
    ids = torch.tensor([[5, 0, 299], [7, 7, 120]])
    rows = quant_linear.embedding(ids, torch.empty(0), holder)
    assert rows.shape == (2, 3, 64) and torch.equal(rows, dense[ids])
    assert torch.equal(quant_linear.embedding(ids, dense), dense[ids])


# ----------------------------------------------------------------------------- tiny GGUF models

def fp32_weights(path: str) -> dict[str, torch.Tensor]:
    """The converter's fp32 weights of a GGUF (Hugging Face names; the lm_head of tied ones too)."""
    checkpoint = load_checkpoint(path)
    weights = dict(checkpoint.weights)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights


def fused(weights: dict[str, torch.Tensor], layer: int, *parts: str) -> torch.Tensor:
    return torch.cat([weights[f"model.layers.{layer}.{part}.weight"] for part in parts])


@needs_kernel
@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen2", False)])
def test_gguf_model_gets_bit_identical_blocks(tmp_path, model_type, tied):
    """Every linear (fused qkv / gate_up, llama's un-permuted q/k, the lm_head) and the embedding get
    their blocks, and they rebuild exactly the fp32 weights the converter wrote."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf", model_type, tied))
    weights = fp32_weights(path)
    model = LLM(path, device="cpu", max_running=2, max_context=64).engine.model
    found = holders(model)
    assert all(h is not None for h in found)
    assert model.lm_head_quant.type_name == ("Q8_0" if tied else "Q4_1")
    assert (model.embed_quant is model.lm_head_quant) == tied and model.embed_quant.type_name == "Q8_0"
    assert torch.equal(model.lm_head_quant.dequantize(), weights["lm_head.weight"])
    assert torch.equal(model.embed_quant.dequantize(), weights["model.embed_tokens.weight"])
    for i, layer in enumerate(model.model.layers):
        qkv = fused(weights, i, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        assert torch.equal(layer.self_attn.qkv_quant.dequantize(), qkv)
        assert torch.equal(layer.self_attn.o_quant.dequantize(), fused(weights, i, "self_attn.o_proj"))
        assert torch.equal(layer.mlp.gate_up_quant.dequantize(), fused(weights, i, "mlp.gate_proj", "mlp.up_proj"))
        assert torch.equal(layer.mlp.down_quant.dequantize(), fused(weights, i, "mlp.down_proj"))


def matrix_names(model) -> list[str]:
    """The model's 2-D parameters: the matrices GGUF blocks stand for (norms and biases stay fp32)."""
    return [name for name, param in model.named_parameters() if "norm" not in name and not name.endswith("bias")]


@needs_kernel
@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen2", False)])
def test_blocks_replace_the_fp32_weights(tmp_path, model_type, tied):
    """With blocks the model keeps no fp32 copy of a matrix (its parameters, fused ones included, are
    empty; the rest are the converter's); with quant_kernels=False every fp32 weight is there; and
    detach_quantized rebuilds them bit-identical, back to fp32 products."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf", model_type, tied))
    weights = fp32_weights(path)
    engine = dict(device="cpu", max_running=2, max_context=64)
    model = LLM(path, **engine).engine.model
    matrices = matrix_names(model)
    assert len(matrices) == 7 * model.config.num_hidden_layers + (1 if tied else 2)
    for name, param in model.named_parameters():
        assert param.numel() == 0 if name in matrices else torch.equal(param, weights[name]), name
    assert model.lm_head.weight.numel() == 0
    for layer in model.model.layers:
        assert layer.self_attn.qkv_weight.numel() == 0 and layer.mlp.gate_up.numel() == 0
    off = LLM(path, quant_kernels=False, **engine).engine.model
    assert all(h is None for h in holders(off)) and off.embed_quant is None
    for name, param in [*off.named_parameters(), ("lm_head.weight", off.lm_head.weight)]:
        assert torch.equal(param, weights[name]), name
    detach_quantized(model)
    assert all(h is None for h in holders(model)) and model.embed_quant is None and model.layer_stack is None
    for name, param in [*model.named_parameters(), ("lm_head.weight", model.lm_head.weight)]:
        assert torch.equal(param, weights[name]), name
    for layer, fp32 in zip(model.model.layers, off.model.layers):
        assert torch.equal(layer.self_attn.qkv_weight, fp32.self_attn.qkv_weight)
        assert torch.equal(layer.mlp.gate_up, fp32.mlp.gate_up)


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


@needs_kernel
def test_blocks_that_differ_from_the_fp32_weights_are_refused(tmp_path, caplog):
    """A blocks file whose matrix does not rebuild the converted weight (here: one scale changed) is
    not used: one log line, and the model runs on its fp32 weights (through the kernel's float32 type)."""
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    blocks_file = resolve_model_dir(path) / gguf_block_store.BLOCKS_FILE
    offset = SafetensorsFile(blocks_file).file_offset("blk.1.ffn_down.weight")
    raw = bytearray(blocks_file.read_bytes())
    raw[offset + 1] ^= 0x40  # row 0's first block: its fp16 scale
    blocks_file.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="flashtree"):
        llm = LLM(path, device="cpu", max_running=1, max_context=64)
    assert all(isinstance(h, Float32Rows) for h in holders(llm.engine.model)) and llm.engine.model.embed_quant is None
    assert any("the GGUF blocks of blk.1.ffn_down.weight differ from the loaded fp32 weights" in r.getMessage()
               for r in caplog.records)
    assert llm.engine.model.lm_head.weight.shape == (96, 64)


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
