"""The fused MoE (flashtree/kernels/gpu/moe.py) in Triton's interpreter on the CPU, float32: it equals
SparseMoE's reference path (6-8 experts, top-2 and top-3, hidden 64, intermediate 32, 1, 5 and 37
tokens), each token's output is bit-identical whatever other tokens share the call, the experts'
weights are stacked with the per-expert parameters left as views, and a tiny Qwen3-MoE target gives
the reference path's logits, features and KV entries with the fused kernels on (and then routes on
the device, so the engine may graph it). tests/support/moe_checks.py runs in a subprocess: the
interpreter must be chosen before Triton compiles anything. (On CUDA: tests/gpu/test_fused_moe.py.)"""

from __future__ import annotations

import pytest

from tests.support.interpreter import run_interpreted

SUMMARY_KEYS = ("plan_valid", "router_chunks")  # check()'s entries that are one verdict, not a case's row


@pytest.fixture(scope="module")
def results():
    return run_interpreted("tests.support.moe_checks")


def test_the_fused_moe_equals_the_reference_path(results):
    cases = {name: row for name, row in results["kernels"].items() if name not in SUMMARY_KEYS}
    assert len(cases) == 3
    for name, row in cases.items():
        assert row["route_agreement"] == 1.0, name
        assert row["route_weight_diff"] < 1e-6 and row["route_counts_ok"], name
        assert row["max_abs_diff"] < 1e-5 * max(1.0, row["scale"]), name
        assert row["max_abs_diff_given_routing"] < 1e-5 * max(1.0, row["scale"]), name
        assert row["stacked_views"], name
    assert results["kernels"]["plan_valid"]


def test_the_router_split_in_k_chunks_still_routes_as_the_reference(results):
    assert results["kernels"]["router_chunks"]


def test_each_token_is_bit_identical_whatever_shares_the_call(results):
    assert all(row["tokens_invariant"] for name, row in results["kernels"].items() if name not in SUMMARY_KEYS)


def test_a_moe_target_on_the_fused_kernels_gives_the_reference_values(results):
    model = results["model"]
    assert model["routes_on_host_reference"] and not model["routes_on_host_fused"]
    worst = {name: diff for name, diff in model["diffs"].items() if diff > 1e-4}
    assert not worst, worst
    assert len(model["diffs"]) == 7  # (kernel_checks._run: prefill, hidden, tree, packed tree and its hidden, sink, KV)
