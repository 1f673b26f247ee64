"""CUDA only (compute capability >= 8.9 for Triton's e4m3): the weight-only FP8 product (issue #38) and FP8
checkpoints end to end. The kernel gives every row bit-identically at M = 1, 7 and 64 with every tile of its
table, in float32 and bfloat16, and the dequantized weight's product up to rounding; a tiny FP8 checkpoint
(128 x 128 block scales that stay blocks, and per-channel scales) keeps its linears FP8 and, in the exact mode,
plain decoding, the DFlash chain and DDTree give the same greedy tokens at batch 1 and 3; its logits are the
dequantized checkpoint's up to rounding, with the exact backend and the fast one (cuBLAS LM head, the fused
small ops). The interpreter's checks: tests/integration/test_fp8_gemm.py."""

import pytest
import torch

from tests.support.fp8_engine_checks import (
    compare_fp8_engine,
    logits_vs_dequantized,
    write_fp8_target,
)
from tests.support.fp8_gemm_checks import LAYOUTS, check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs CUDA with compute capability >= 8.9")


def test_fp8_rows_are_identical_with_every_tile_and_match_the_dequantized_product():
    results = check((torch.float32, torch.bfloat16), device="cuda")
    for layout in LAYOUTS:
        for dtype, bound in (("torch.float32", 1e-5), ("torch.bfloat16", 1e-2)):  # bf16: one rounding of y
            result = results[f"{layout}/{dtype}"]
            assert result["rows_identical"] and result["chunks_identical"] and result["batched_3d"], (layout, dtype, result)
            assert result["chunked_relative_diff"] < bound, (layout, dtype, result)
            assert result["relative_diff"] < bound, (layout, dtype, result)


@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_speculative_tokens_equal_plain_tokens(layout, dtype, tmp_path):
    differing = compare_fp8_engine("cuda", str(tmp_path), dtype=dtype, layout=layout, shape="blocks", max_tokens=24)
    assert differing["scale_rows_128"] == float(layout == "block"), differing  # the block path ran
    assert not any(v for k, v in differing.items() if k != "scale_rows_128"), differing


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("bfloat16", 0.05)])
def test_fp8_logits_are_the_dequantized_checkpoints(dtype, bound, exact, tmp_path):
    fp8, reference = write_fp8_target(tmp_path, "block", "blocks")
    assert logits_vs_dequantized(fp8, reference, "cuda", dtype, exact) < bound


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])  # the Qwen3-8B shape's qkv and down products
def test_fp8_rows_are_identical_at_the_8b_shapes_and_row_counts(n, k):
    """The row counts a DDTree-16 round and a plain step of 4 prompts give the product (68 and 4), and those of
    1 and 17 (batch 1), on weights as an 8B checkpoint holds them (N(0, 0.02) quantized in 128 x 128 blocks) and
    bf16 activations of a hidden state's size: every row equals the one-row product's bits."""
    from flashtree.kernels.gpu.fp8_gemm import SCALE_BLOCK, Fp8Linear
    from flashtree.models.fp8 import quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    values, scale = quantize_fp8(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    layer = Fp8Linear(values, scale, SCALE_BLOCK)
    x = torch.randn(68, k, device="cuda", generator=gen).to(torch.bfloat16)  # [68, K]
    alone = torch.cat([layer(x[i:i + 1]) for i in range(68)])  # [68, N], one row at a time
    for m in (4, 17, 68):
        assert torch.equal(layer(x[:m]), alone[:m]), m
