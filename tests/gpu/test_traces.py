"""CUDA only: a tree trace observes graph-replayed and queued rounds without changing them."""

import json

import pytest
import torch

from flashtree import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_trace_trees_with_cuda_graphs_equal_the_eager_trace(tmp_path):
    from tests.dflash_helpers import ScriptedNodes, tiny_pair
    from tests.support.traces import by_request_order

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs, traces = {}, {}
    for graphs in (False, True):
        path = tmp_path / f"trees_{graphs}.jsonl"
        llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, device="cuda", dtype="float32",
                  cuda_graphs=graphs, max_running=4, max_context=256, adaptive_spec=False, trace_trees=str(path))
        llm.engine.policy = ScriptedNodes([8, 0, 0, 0, 4, 0])
        outs[graphs] = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
        traces[graphs] = by_request_order([json.loads(line) for line in path.read_text().splitlines()])
        if graphs:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
            assert llm.engine.queued_rounds > 0  # plain rounds queued with the trace on
    assert outs[True] == outs[False]
    assert traces[True] == traces[False] and len(traces[True]) == sum(len(a) for _, a in outs[True])
