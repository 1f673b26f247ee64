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
    from tests.dflash_helpers import ScriptedNodes, tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = [SamplingParams(max_tokens=150 - 9 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(3)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=8, device="cuda", dtype="float32",
                  cuda_graphs=graphs, max_running=4, max_context=256, adaptive_spec=False)
        capacity = llm.engine.proposer.lag.capacity
        llm.engine.policy = ScriptedNodes([0] * (capacity + 7) + [4, 0, 4])
        outs[graphs] = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
        if graphs:
            assert any(key[0] == "catch_up" for key in llm.engine.runner.graphs.graphs)
    assert outs[True] == outs[False]
    assert any(max(lengths) > 1 for _, lengths in outs[True])


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_queued_plain_rounds_equal_unqueued_on_cuda(tmp_path, spec):
    """Plain rounds queued before the round ahead is read (engine.py, "Queued plain rounds"), graphed,
    with catch-ups, drafted rounds, stop tokens, seeded sampling and slots reused by later requests:
    the tokens and acceptance of an engine that reads every round before queuing the next."""
    from tests.dflash_helpers import ScriptedNodes, tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9, [5, 4, 3, 2], [9, 9, 1]]
    params = [SamplingParams(max_tokens=150 - 9 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(5)]
    params[3] = SamplingParams(max_tokens=60, stop_token_ids=(5, 6))
    outs, queued = {}, {}
    for queue in (False, True):
        kwargs = {} if spec == "none" else dict(spec=spec, draft=str(pair.drafter), budget=8, adaptive_spec=False)
        llm = LLM(str(pair.target), device="cuda", dtype="float32", max_running=3, max_context=256,
                  queue_plain_rounds=queue, **kwargs)
        if spec != "none":
            capacity = llm.engine.proposer.lag.capacity
            llm.engine.policy = ScriptedNodes([0] * (capacity + 7) + [4, 0, 4])
        outs[queue] = [(o.token_ids, o.acceptance_lengths, o.finish_reason) for o in llm.generate(prompts, params)]
        queued[queue] = llm.engine.queued_rounds
    assert outs[True] == outs[False]
    assert queued[False] == 0 and queued[True] > 100


@pytest.mark.parametrize("spec,budget", [("dflash", None), ("ddtree", 16)])
def test_graphed_rounds_with_a_draft_vocabulary_equal_plain(tmp_path, spec, budget):
    """``--draft-vocab``: with the draft-index map after the tree kernels inside replayed graphs, a
    drafter restricted to its ranking's first half keeps plain decoding's tokens."""
    import shutil

    from flashtree.train.draft_vocab import write_ranking
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    draft = tmp_path / "ranked"
    shutil.copytree(pair.drafter, draft)
    ranking = torch.randperm(24, generator=torch.Generator().manual_seed(2)).tolist()
    write_ranking(ranking, draft)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_running=4, max_context=256)
    plain = [o.token_ids for o in LLM(str(pair.target), **common).generate(prompts, params)]
    fast = LLM(str(pair.target), spec=spec, draft=str(draft), budget=budget, draft_vocab=12, adaptive_spec=False,
               **common)
    assert fast.engine.proposer.runner.vocab_ids.tolist() == ranking[:12]
    assert [o.token_ids for o in fast.generate(prompts, params)] == plain
    assert fast.engine.runner.graphs is not None and fast.engine.runner.graphs.graphs


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_graphed_logprobs_equal_eager(tmp_path, spec):
    """Log-probabilities computed inside graphed rounds (queued plain rounds included) and copied
    out through pinned buffers: the eager engine's, for every emitted token."""
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, logprobs=k, temperature=0.8 * (k == 2), seed=k)
              for k in (None, 2, 5)]
    outs = {}
    for graphs in (False, True):
        draft = {} if spec == "none" else dict(spec=spec, draft=str(pair.drafter), budget=16)
        llm = LLM(str(pair.target), **draft, device="cuda", dtype="float32", cuda_graphs=graphs, max_running=4,
                  max_context=256)
        outs[graphs] = llm.generate(prompts, params)
    for eager, graphed in zip(outs[False], outs[True]):
        assert graphed.token_ids == eager.token_ids
        if eager.logprobs is None:
            assert graphed.logprobs is None
            continue
        assert len(graphed.logprobs) == len(graphed.token_ids)
        for a, b in zip(eager.logprobs, graphed.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_graphed_penalties_and_min_tokens_equal_eager_plain(tmp_path, spec):
    """Adjusted rows (penalties, min_tokens) beside plain ones, graphed, equal eager plain decoding."""
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    prompts = [[1, 2, 3], list(range(2, 20)), [7] * 9, [4, 5]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.5, seed=0),
              SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=1.0, temperature=0.8, seed=1),
              SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=8, stop_token_ids=(3, 7), seed=2),
              SamplingParams(max_tokens=30, ignore_eos=True, seed=3)]
    common = dict(device="cuda", dtype="float32", max_running=4, max_context=256)
    eager = [o.token_ids for o in LLM(str(pair.target), cuda_graphs=False, **common).generate(prompts, params)]
    drafted = dict(spec=spec, draft=str(pair.drafter), budget=8) if spec != "none" else {}
    llm = LLM(str(pair.target), **drafted, **common)
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    assert llm.engine.runner.graphs.graphs


def test_graph_cache_counts_replays_and_their_host_time():
    from flashtree.engine.graphs import GraphCache

    cache = GraphCache()
    x = torch.ones(8, device="cuda")
    for _ in range(3):
        out = cache.run("double", lambda t: t * 2, [x])
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    assert (cache.captures, cache.replays) == (1, 3)
    assert cache.replay_host_seconds > 0.0
