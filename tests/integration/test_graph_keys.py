"""The graphs the engine captures at start-up are the ones its rounds ask for: with a pass-through
graph cache (CPU), every round of plain, DFlash, DDTree and the adaptive default, greedy and sampled,
at 1 to 4 rows, finds its key among ``ModelRunner.graph_keys`` once the cache is frozen, and the
tokens stay plain decoding's; a round with log-probabilities (no start-up graph) runs eagerly."""

import pytest

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import PassThroughGraphs, tiny_pair

ENGINE = dict(device="cpu", max_running=4, max_context=160, prefill_chunk=16)
PROMPTS = [list(range(2, 20)), [5, 6], list(range(3, 12)) * 2, [7] * 9]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("keys"), vocab=24, block_size=6)


def startup_captured(llm: LLM) -> PassThroughGraphs:
    """The engine's runner with a pass-through cache, its start-up graphs captured and frozen."""
    engine = llm.engine
    engine.runner.graphs = graphs = PassThroughGraphs()
    keys = engine.runner.graph_keys(engine.policy.ladder, engine.config.scheduler.max_running, 4096)
    assert keys
    engine.runner.capture_graphs(keys)
    assert graphs.frozen and graphs.captures == len(set(keys))
    return graphs


@pytest.mark.parametrize("spec,adaptive,packed", [("none", True, None), ("dflash", False, None), ("ddtree", False, None),
                                                 ("ddtree", True, None), ("ddtree", False, True), ("ddtree", True, True)])
def test_serving_finds_every_graph(pair, spec, adaptive, packed):
    plain = LLM(str(pair.target), **ENGINE)
    drafted = dict(spec=spec, draft=str(pair.drafter), budget=8) if spec != "none" else {}
    llm = LLM(str(pair.target), adaptive_spec=adaptive, packed_verify=packed, **drafted, **ENGINE)
    graphs = startup_captured(llm)
    for params in (SamplingParams(max_tokens=24, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.9, top_k=5, seed=4, ignore_eos=True)):
        for rows in (1, 3, 4):
            want = [o.token_ids for o in plain.generate(PROMPTS[:rows], params)]
            assert [o.token_ids for o in llm.generate(PROMPTS[:rows], params)] == want, (params, rows)
    assert graphs.eager_runs == 0
    with_logprobs = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    want = [o.token_ids for o in plain.generate(PROMPTS[:2], with_logprobs)]
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], with_logprobs)] == want
    assert graphs.eager_runs > 0


def test_rounds_past_the_token_cap_are_left_out(pair):
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **ENGINE)
    llm.engine.runner.graphs = PassThroughGraphs()
    keys = llm.engine.runner.graph_keys((8, 4, 0), 4, 20)  # rows x (nodes + 1) <= 20
    rounds = {(key[0], key[1].nodes) for key in keys if key[0] != "catch_up"}
    assert rounds == {(1, 8), (1, 4), (1, 0), (2, 8), (2, 4), (2, 0), (4, 4), (4, 0)}
    assert sum(key[0] == "catch_up" for key in keys) == 3


def test_keys_run_widest_first_and_follow_the_schedulers_round_bound(pair):
    """Captures share one memory pool: the widest rounds come first (the sampled, filtered variant first among
    equals), so narrower ones reuse their blocks; ``max_round_tokens`` 10 leaves out the drafted rounds the policy
    would never run (4 rows x 5 tokens, 2 rows x 9)."""
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **ENGINE)
    llm.engine.runner.graphs = PassThroughGraphs()
    keys = [key for key in llm.engine.runner.graph_keys((8, 4, 0), 4, 20) if key[0] != "catch_up"]
    tokens = [width * (shape.nodes + 1) for width, shape in keys]
    assert tokens == sorted(tokens, reverse=True) and keys[0][1].any_filtered
    bounded = llm.engine.runner.graph_keys((8, 4, 0), 4, 20, max_round_tokens=10)
    rounds = {(key[0], key[1].nodes) for key in bounded if key[0] != "catch_up"}
    assert rounds == {(1, 8), (1, 4), (1, 0), (2, 4), (2, 0), (4, 0)}


def test_packed_rounds_are_keyed_by_their_total(pair):
    """``packed_verify=True``: a round of n nodes per row over W padded rows verifies W x (n + 1) tokens packed, from
    trees of up to 4n (at most the budget); the keys run widest first by that total."""
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, packed_verify=True, **ENGINE)
    llm.engine.runner.graphs = PassThroughGraphs()
    keys = [key for key in llm.engine.runner.graph_keys((8, 4, 0), 4, 20) if key[0] != "catch_up"]
    rounds = {(width, shape.nodes, shape.tokens) for width, shape in keys}
    assert rounds == {(1, 8, 9), (1, 8, 5), (1, 0, None), (2, 8, 18), (2, 8, 10), (2, 0, None), (4, 8, 20), (4, 0, None)}
    totals = [shape.tokens or width for width, shape in keys]
    assert totals == sorted(totals, reverse=True)
