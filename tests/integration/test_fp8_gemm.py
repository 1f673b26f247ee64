"""The weight-only FP8 product (flashtree/kernels/gpu/fp8_gemm.py, issue #38) in Triton's interpreter on the CPU
(float32: the interpreter has no bfloat16 arithmetic, but it loads e4m3 tensors and converts them exactly, NaN
codes aside, which checkpoints do not hold). Each runs in a subprocess: the interpreter must be chosen before
Triton compiles anything.

- the kernel, for 128 x 128 block scales, per-row block scales and per-channel scales: the dequantized
  weight's product up to float32 rounding, and every row bit-identical whether the product has 1, 7 or 64 rows
  and whatever rows share it (tests/support/fp8_gemm_checks.py);
- a tiny FP8 checkpoint end to end in the exact mode: the target keeps its linears FP8, plain decoding gives a
  prompt the same greedy tokens alone and in a batch of 3, DDTree gives plain decoding's tokens at batch 1 and 3,
  and the logits are the dequantized checkpoint's up to rounding (tests/support/fp8_engine_checks.py)."""

from __future__ import annotations

from tests.support.interpreter import run_interpreted


def test_fp8_rows_are_identical_whatever_the_row_count_and_match_the_dequantized_product():
    results = run_interpreted("tests.support.fp8_gemm_checks", timeout=300)
    assert set(results) == {"block/torch.float32", "row_blocks/torch.float32", "channel/torch.float32"}
    for layout, result in results.items():
        assert result["rows_identical"] and result["chunks_identical"] and result["batched_3d"], (layout, result)
        assert result["chunked_relative_diff"] < 1e-5, (layout, result)
        assert result["relative_diff"] < 1e-5, (layout, result)


def test_fp8_speculative_tokens_equal_plain_tokens(tmp_path):
    results = run_interpreted("tests.support.fp8_engine_checks", str(tmp_path), timeout=900)
    differing = results["tokens_differing"]
    assert "ddtree/vs_plain_batch_1" in differing
    assert not any(v for k, v in differing.items() if k != "scale_rows_128"), differing
    assert results["logits_vs_dequantized"] < 1e-5, results
