"""CUDA only: the row-invariant product gives every row bit-identically at M = 1, 7 and 64 in float32
and bfloat16, and F.linear's values up to rounding (the interpreter's check: tests/integration)."""

import pytest
import torch

from tests.support.gemm_checks import check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_rows_are_identical_whatever_the_row_count():
    results = check((torch.float32, torch.bfloat16), device="cuda")
    assert all(results[d]["rows_identical"] and results[d]["chunks_identical"] for d in ("torch.float32", "torch.bfloat16"))
    assert results["torch.float32"]["max_abs_diff"] < 1e-3
    assert results["torch.bfloat16"]["max_abs_diff"] < 0.5  # one bf16 rounding of |y| up to ~40


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])  # the Qwen3-8B shape's qkv and down products
def test_rows_are_identical_at_the_8b_shapes_with_every_tile(n, k):
    """bf16 weights of an 8B layer's size, rows of a plain step (1, 4) and of verify forwards (17, 68, 272):
    every row equals the one-row product's bits, with the table's tiles (the FP8 kernel's 64-row tiles did
    not at these shapes, though they did at small ones)."""
    from flashtree.kernels.gpu.gemm import TILES, invariant_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(272, k, device="cuda", generator=gen).to(torch.bfloat16)  # [272, K]
    picked = list(range(0, 272, 17))
    alone = torch.cat([invariant_linear(x[i:i + 1], weight) for i in picked])  # [16, N]
    for m in (4, 17, 68, 272):
        rows = [i for i in picked if i < m]
        assert torch.equal(invariant_linear(x[:m], weight)[rows], alone[:len(rows)]), m
    for _, tile in TILES:
        assert torch.equal(invariant_linear(x, weight, tile=tile)[picked], alone), tile


@pytest.mark.parametrize("product", ["invariant", "fp8"])
def test_split_products_ended_in_their_last_programs_give_the_sum_kernels_bits_every_time(product):
    """The 8B shape's o product at one and four rows, split by K chunks: ended by each tile's last program to
    arrive (gemm.FUSED_SUM's way: an arrival count, then the ordered sum) it gives the sum kernel's bits on 200
    eager calls and 50 graph replays in a row (a partial read before it is stored would show as a mismatch)."""
    if product == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 needs compute capability >= 8.9")
    from flashtree.kernels.gpu.fp8_gemm import SCALE_BLOCK, fp8_linear
    from flashtree.kernels.gpu.gemm import invariant_linear
    from flashtree.models.fp8 import quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02
    if product == "fp8":
        values, scale = quantize_fp8(weight)
        run = lambda x, fused: fp8_linear(x, values, scale, SCALE_BLOCK, split=True, fused_sum=fused)  # noqa: E731
    else:
        weight = weight.to(torch.bfloat16)
        run = lambda x, fused: invariant_linear(x, weight, split=True, fused_sum=fused)  # noqa: E731
    for m in (1, 4):
        x = torch.randn(m, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        expected = run(x, False)
        assert all(torch.equal(run(x, True), expected) for _ in range(200)), m
        graph, out = torch.cuda.CUDAGraph(), None
        run(x, True)  # (compiled before the capture)
        with torch.cuda.graph(graph):
            out = run(x, True)
        for _ in range(50):
            out.zero_()
            graph.replay()
            assert torch.equal(out, expected), m
