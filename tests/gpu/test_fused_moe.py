"""CUDA only: the fused MoE (flashtree/kernels/gpu/moe.py) against SparseMoE's reference path in
float32 and bfloat16 (tests/support/moe_checks.py; the interpreter's check: tests/integration), a MoE
target's forward captured as a CUDA graph and replayed on new inputs, and the engine on a tiny
Qwen3-MoE pair: its rounds graphed, DFlash and DDTree tokens equal to plain decoding's (greedy, fp32)."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.batch import ForwardBatch, causal_mask
from tests.helpers import make_cache, ours_from_hf, tiny_hf_model
from tests.support.moe_checks import check, model_check, tiles_invariant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [list(range(2, 20)), [5, 6], list(range(3, 12)) * 2, [7] * 9, [1, 2, 3]]


def test_the_fused_moe_equals_the_reference_path_in_float32_and_bfloat16():
    results = check((torch.float32, torch.bfloat16), device="cuda")
    assert results.pop("plan_valid") and results.pop("router_chunks")
    for name, row in results.items():
        scale = max(1.0, row["scale"])
        assert row["tokens_invariant"] and row["stacked_views"] and row["route_counts_ok"], name
        if name.endswith("float32"):
            assert row["route_agreement"] == 1.0, name
            assert row["max_abs_diff"] < 1e-5 * scale and row["max_abs_diff_given_routing"] < 1e-5 * scale, name
        else:  # bfloat16: the reference rounds its products and each addend; the fused path rounds act and the sum
            assert row["route_agreement"] >= 0.9, name
            assert row["max_abs_diff_given_routing"] < 0.02 * scale, name
            assert row["max_abs_diff"] < 0.05 * scale, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_column_tiles_do_not_change_a_result(dtype):
    assert tiles_invariant("cuda", dtype)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_a_moe_target_on_the_fused_kernels_gives_the_reference_values(dtype, tolerance):
    results = model_check("cuda", dtype)
    assert results["routes_on_host_reference"] and not results["routes_on_host_fused"]
    worst = {name: diff for name, diff in results["diffs"].items() if diff > tolerance}
    assert not worst, worst


def _decode_batch(ids: torch.Tensor, lengths: torch.Tensor) -> ForwardBatch:
    """One new token per row after ``lengths`` committed ones (slots 0..B-1)."""
    rows = ids.shape[0]
    return ForwardBatch(ids, lengths[:, None].clone(), torch.arange(rows, device=ids.device), lengths,
                        torch.ones(rows, 1, 1, dtype=torch.bool, device=ids.device), kv_len=int(lengths.max()) + 1)


def test_a_moe_forward_replays_as_a_cuda_graph():
    model = ours_from_hf(tiny_hf_model("qwen3_moe"), device="cuda", dtype=torch.float32)
    assert model.use_gpu_kernels(attention=None)
    cache = make_cache(model)
    prompt = torch.randint(0, 97, (3, 9), device="cuda")
    counts = torch.full((3,), 9, device="cuda")
    model(ForwardBatch(prompt, torch.arange(9, device="cuda").expand(3, -1), torch.arange(3, device="cuda"),
                       torch.zeros(3, dtype=torch.long, device="cuda"), causal_mask(counts, 9), kv_len=9), cache)
    ids = torch.zeros(3, 1, dtype=torch.long, device="cuda")
    lengths = counts.clone()
    batch = _decode_batch(ids, lengths)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(batch, cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(batch, cache).logits
    for new in ([[4], [17], [60]], [[88], [88], [1]]):
        ids.copy_(torch.tensor(new))
        graph.replay()
        replayed = captured.clone()
        eager = model(_decode_batch(ids.clone(), lengths.clone()), cache).logits
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)  # (cuBLAS may pick other kernels eagerly)
    assert not torch.equal(replayed[0], replayed[2])  # the inputs reached the graph


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_speculation_on_a_graphed_moe_target_gives_the_plain_tokens(tmp_path, spec):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, family="qwen3_moe", vocab=24, block_size=6)
    common = {"device": "cuda", "dtype": "float32", "max_running": 8, "max_context": 256, "adaptive_spec": False}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eager = LLM(str(pair.target), cuda_graphs=False, **common)
    plain = LLM(str(pair.target), **common)
    assert plain.engine.runner.graphs is not None
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == want
    fast = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=8, **common)
    outs = fast.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert fast.engine.runner.graphs is not None and fast.engine.runner.graphs.graphs
    assert fast.engine.graph_counts[0] == 0  # every round replayed a start-up graph
