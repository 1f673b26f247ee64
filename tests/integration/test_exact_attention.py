"""The exact mode (issue #29) on the CPU in Triton's interpreter (float32; the interpreter has no bfloat16
arithmetic, so bf16 is left to tests/gpu/test_exact_mode.py): the exact attention gives a tree node what a
plain step at its position gets, whatever the batch and the chunking (tests/support/exact_attention_checks.py),
and on a tiny random pair plain decoding, DDTree, a prompt alone and in a batch all give the same greedy tokens,
and the exact backend's outputs are the unfused model's up to rounding (tests/support/exact_mode_checks.py). Each runs in a subprocess: the interpreter must be chosen before Triton
compiles anything."""

from __future__ import annotations

from tests.support.interpreter import run_interpreted


def test_a_query_gets_what_its_logical_keys_give_whatever_shares_the_launch():
    results = run_interpreted("tests.support.exact_attention_checks")["torch.float32"]
    assert results["tree_equals_plain"] and results["batch_and_chunk_invariant"]
    assert results["parallel_equals_sequential"]
    assert results["max_abs_diff"] < 1e-5


def test_exact_mode_tokens_equal_plain_alone_and_batched(tmp_path):
    results = run_interpreted("tests.support.exact_mode_checks", str(tmp_path), timeout=900)
    differing = results["tokens_differing"]
    assert differing and not any(differing.values()), differing
    assert max(results["vs_unfused"].values()) < 1e-4, results["vs_unfused"]  # logits, hidden states, KV entries
