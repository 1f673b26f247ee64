"""CUDA only: graph-replayed rounds give the same tokens as eager rounds."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.helpers import tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_rounds_equal_eager_rounds(tmp_path):
    tiny_hf_model("qwen3_qknorm").save_pretrained(tmp_path)
    prompts = [[1, 2, 3], list(range(5, 30)), [7] * 9]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", cuda_graphs=graphs, max_running=4,
                  max_context=256)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, greedy) + llm.generate(prompts, sampled)]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("spec,budget", [("dflash", None), ("ddtree", 8), ("ddtree", 64)])
def test_speculative_graph_rounds_equal_plain(tmp_path, spec, budget):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_running=4, max_context=256)
    plain = [o.token_ids for o in LLM(str(pair.target), **common).generate(prompts, params)]
    fast = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=budget, **common)
    outs = fast.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert fast.engine.runner.graphs is not None and fast.engine.runner.graphs.graphs
    if spec == "ddtree" and budget == 64:
        assert max(max(o.acceptance_lengths) for o in outs) > 1


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_graphed_plain_stretches_and_catch_ups_equal_eager(tmp_path, spec):
    """Plain rounds (the short path) and the full-width drafter catch-ups they lead to, graphed,
    give the eager engine's tokens and drafted rounds' acceptance."""
    from tests.dflash_helpers import tiny_pair
    from tests.dflash_helpers import ScriptedNodes

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = [SamplingParams(max_tokens=150 - 9 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(3)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=8, device="cuda", dtype="float32",
                  cuda_graphs=graphs, max_running=4, max_context=256, adaptive_spec=False)
        capacity = llm.engine.proposer.lag_capacity
        llm.engine.policy = ScriptedNodes([0] * (capacity + 7) + [4, 0, 4])
        outs[graphs] = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
        if graphs:
            assert any(key[0] == "catch_up" for key in llm.engine.runner.graphs.graphs)
    assert outs[True] == outs[False]
    assert any(max(lengths) > 1 for _, lengths in outs[True])
