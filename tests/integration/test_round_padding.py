"""Graphed rounds pad their rows to the next power of two with the engine's pad slot: the pad
rows must not change any real row's tokens (greedy and seeded), must not touch any request's
KV, and batch sizes in one power-of-two bucket must share one graph key. A neighbour probe's
tree round whose graph is not captured is declined unless its option could win.

CUDA graphs need a GPU; here a pass-through graph cache (records keys, runs the function
eagerly) drives the same padded code path on the CPU."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.policy.adaptive import PolicyConfig
from tests.dflash_helpers import PassThroughGraphs, ScriptedNodes, one_thread, tiny_pair  # noqa: F401  (fixture)
from tests.support.clocks import modelled_round_times, use_read_count_clock
from tests.support.workload import BLOCK, PROMPTS, VOCAB

ENGINE = dict(max_running=8, max_context=96, prefill_chunk=8, adaptive_spec=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("padding"), vocab=VOCAB, block_size=BLOCK)


def padded(llm: LLM) -> PassThroughGraphs:
    graphs = PassThroughGraphs()
    llm.engine.runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_padded_rounds_give_the_unpadded_tokens(pair, method):
    draft = None if method == "none" else str(pair.drafter)
    reference = LLM(str(pair.target), spec=method, draft=draft, budget=8, **ENGINE)
    llm = LLM(str(pair.target), spec=method, draft=draft, budget=8, **ENGINE)
    graphs = padded(llm)
    for rows in (3, 5, 7):  # padded to 4, 8, 8
        prompts = PROMPTS[:rows]
        params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                                 seed=i) for i in range(rows)]
        expected = reference.generate(prompts, params)
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    rounds = {key[0] for key in graphs.keys if key[0] != "catch_up"}
    catch_ups = {key[1] for key in graphs.keys if key[0] == "catch_up"}  # (every catch-up is graphed)
    assert rounds | catch_ups <= {1, 2, 4, 8}  # rows in the key: powers of two only
    assert rounds >= {4, 8}
    assert bool(catch_ups) == (method != "none")


def test_pad_rows_write_only_the_pad_slot(pair):
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **ENGINE)
    padded(llm)
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS[:3]]
    before = engine.cache.storage.clone()
    for _ in range(6):
        engine.step()
    assert engine.runner.pad_slot == engine.config.scheduler.max_running
    assert sorted(r.slot for r in reqs) == [0, 1, 2]
    pool = engine.pages.pool
    free = [page for page in range(1, pool.num_pages) if pool.refcounts[page] == 0]  # pages no slot holds
    assert free and (engine.cache.storage[:, :, free] == before[:, :, free]).all()
    assert int(engine.cache.lengths[engine.runner.pad_slot]) <= 9  # reset every round, never grows


@pytest.mark.parametrize("worth", [False, True])
def test_neighbour_probes_without_a_graph_are_declined_unless_worth_one(pair, monkeypatch, worth):
    """Every probe meets a shape without a graph here: it is declined (the round runs the best
    option) when the policy says its option cannot win, and runs (capturing) when it can; the
    tokens are plain decoding's either way. The policy gets modelled round times, and the engine's
    clock counts its reads (which rounds go untimed: tests/support/clocks.py)."""
    use_read_count_clock(monkeypatch)
    plain = LLM(str(pair.target), **ENGINE)
    knobs = dict(ENGINE, adaptive_spec=True, spec_policy=PolicyConfig(
        explore_rounds=1, probe_interval=3, max_probe_interval=3, plain_recheck_interval=1000))
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **knobs)
    padded(llm)
    runner, policy = llm.engine.runner, llm.engine.policy
    monkeypatch.setattr(runner, "has_graph", lambda rows, nodes: False)  # as if every shape were new
    monkeypatch.setattr(policy, "worth_a_graph", lambda rows, nodes: worth)
    modelled_round_times(policy, monkeypatch)
    declined, probe_rounds = [], []
    real_decline, real_launch = policy.decline_probe, runner.launch

    def decline():
        declined.append(policy._probe.nodes)
        real_decline()

    def spy(rows, nodes=None, *rest):
        if policy.probing:
            probe_rounds.append(nodes)
        return real_launch(rows, nodes, *rest)

    monkeypatch.setattr(policy, "decline_probe", decline)
    monkeypatch.setattr(runner, "launch", spy)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    if worth:
        assert not declined and len(probe_rounds) >= 4
    else:
        assert not probe_rounds and len(declined) >= 4 and all(nodes > 0 for nodes in declined)


def test_graphed_catch_ups_give_the_eager_tokens_and_leave_the_pad_slot_alone(pair, monkeypatch):
    """Plain stretches longer than the drafter's lag run full-width catch-ups, graphed (padded to
    a power of two) when graphs are on: the tokens and the drafted rounds' acceptance are the
    eager engine's, and the pad slot's drafter context does not grow. (At a GPU's lag capacity: a
    CPU's is longer than these requests.)"""
    import flashtree.speculative.drafter as drafter_module

    monkeypatch.setattr(drafter_module, "lag_capacity", lambda *_: drafter_module.LAG_CAPACITY)
    knobs = dict(ENGINE, max_context=256)
    reference = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **knobs)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, **knobs)
    graphs = padded(llm)
    capacity = llm.engine.proposer.lag.capacity
    for engine in (reference.engine, llm.engine):
        engine.policy = ScriptedNodes([0] * (capacity + 10) + [3, 0, 3])
    params = [SamplingParams(max_tokens=2 * capacity + 30 - 7 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(3)]
    expected = reference.generate(PROMPTS[:3], params)
    got = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.acceptance_lengths for o in got] == [o.acceptance_lengths for o in expected]
    assert ("catch_up", 4, capacity) in graphs.keys  # 3 rows padded to 4
    drafter_cache = llm.engine.proposer.runner.cache
    assert int(drafter_cache.lengths[llm.engine.runner.pad_slot]) <= BLOCK
