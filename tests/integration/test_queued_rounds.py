"""Queued plain rounds (engine/overlap.py): the next plain round is queued before
the host reads the current one. On a CPU the queued round runs at once, so these tests check the
bookkeeping a GPU relies on: the same tokens as unqueued plain decoding (greedy, stop tokens,
length limits, seeded sampling, aborts, slots reused right after a row finished), one round per
token, and a drafter that stays in sync through queued rounds."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.config import PolicyConfig
from tests.dflash_helpers import PassThroughGraphs, ScriptedNodes, one_thread, tiny_pair
from tests.support.clocks import modelled_round_times, use_read_count_clock
from tests.support.workload import BLOCK, PROMPTS, VOCAB, mixed_params

ENGINE = dict(max_running=3, max_context=96, prefill_chunk=8)  # few slots: finished rows' slots are reused
SETTLES = PolicyConfig(explore_rounds=1, probe_interval=20)  # a drafter that never matches: plain soon


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("queued"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE, queue_plain_rounds=False)


def queued_llm(pair, method: str, graphed: bool) -> LLM:
    spec = {} if method == "none" else dict(spec=method, draft=str(pair.drafter), budget=16, spec_policy=SETTLES)
    llm = LLM(str(pair.target), **ENGINE, **spec, queue_plain_rounds=True)
    if graphed:  # a queued round needs its graph captured already (a capture would wait for the device)
        llm.engine.runner.graphs = PassThroughGraphs()
    return llm


def run_staggered(llm: LLM, prompts, params, abort_at: dict[int, int]) -> list:
    """Requests join two steps apart (prefills between queued rounds); request i is aborted after
    step ``abort_at[i]``. Returns the requests."""
    engine = llm.engine
    reqs, step = [], 0
    pending = list(zip(prompts, params))
    while pending or engine.has_work:
        if pending and step % 2 == 0:
            prompt, p = pending.pop(0)
            reqs.append(engine.add_request(prompt, p))
        engine.step()
        step += 1
        for i, at in abort_at.items():
            if at == step and i < len(reqs):
                engine.abort(reqs[i].request_id)
    return reqs


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_queued_rounds_give_plain_decodings_tokens(pair, plain, method, graphed, monkeypatch):
    """(The policy gets modelled round times on a read-count clock, tests/support/clocks.py: it
    settles on plain rounds for the random drafter on every machine.)"""
    use_read_count_clock(monkeypatch)
    prompts = PROMPTS * 2
    params = mixed_params(plain, prompts)
    params[4] = SamplingParams(max_tokens=30, temperature=0.9, top_k=5, seed=7, ignore_eos=True)
    params[9] = SamplingParams(max_tokens=30, temperature=1.2, top_p=0.8, seed=3, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=60, ignore_eos=True)  # aborted mid-way
    llm = queued_llm(pair, method, graphed)
    modelled_round_times(llm.engine.policy, monkeypatch)
    got = run_staggered(llm, prompts, params, abort_at={2: 25})
    expected = run_staggered(plain, prompts, params, abort_at={2: 25})
    assert llm.engine.queued_rounds > 20  # most rounds once the policy settled
    for out, ref in zip(got, expected):
        assert out.finish_reason == ref.finish_reason
        if ref.finish_reason == "abort":
            n = min(len(out.output_ids), len(ref.output_ids))  # (aborted after different step counts)
            assert n > 3 and out.output_ids[:n] == ref.output_ids[:n]
        else:
            assert out.output_ids == ref.output_ids
        # every round's tokens were appended once (a queued round's token for a row that finished is dropped)
        assert out.stats.rounds == len(out.stats.acceptance_lengths)
        assert sum(out.stats.acceptance_lengths) == len(out.output_ids) - 1  # (the first came from prefill)


def test_a_finished_rows_queued_token_is_dropped(pair, plain):
    """A row that stops on a token ran one more token in the queued round; none of it shows."""
    prompt = PROMPTS[1]
    free = plain.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    stop = free[8]
    first_stop = free.index(stop)
    llm = queued_llm(pair, "none", graphed=False)
    out = llm.generate([prompt, PROMPTS[4]], [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)),
                                              SamplingParams(max_tokens=40, ignore_eos=True)])
    assert out[0].token_ids == free[:first_stop + 1] and out[0].finish_reason == "stop"
    assert llm.engine.queued_rounds > 0


@pytest.mark.parametrize("graphed", [False, True])
def test_queued_rounds_catch_the_drafter_up_when_a_lag_fills(pair, plain, monkeypatch, graphed):
    """With a lag capacity of 4, a queued round whose rows' lag would fill catches the drafter up
    first (on the device, as the engine's own catch-up does); after every step the drafter's
    context holds each row's committed tokens but its lag, and the tokens are plain decoding's."""
    import flashtree.speculative.drafter as proposer_module

    monkeypatch.setattr(proposer_module, "lag_capacity", lambda *_: 4)
    llm = queued_llm(pair, "ddtree", graphed)
    engine = llm.engine
    # one tree round, then plain rounds: the measured policy's choice depends on round times (a CI
    # machine on which the tiny tree rounds were cheap enough kept drafting, and caught up twice)
    engine.policy = ScriptedNodes([max(engine.policy.ladder)] + [0] * 60)
    catch_ups = []
    real = engine.runner.launch_plain_after

    def spy(previous, catch_up=False):
        launched = real(previous, catch_up)
        catch_ups.append(catch_up and launched is not None)
        return launched

    monkeypatch.setattr(engine.runner, "launch_plain_after", spy)
    prompts = [p for p in PROMPTS if len(p) > ENGINE["prefill_chunk"]][:2]  # (not deferred at prefill)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = [engine.add_request(prompt, params) for prompt in prompts]
    drafter_lengths = engine.proposer.runner.cache.lengths
    while engine.has_work:
        engine.step()
        for req in reqs:
            if not req.finished and req.output_ids:
                assert int(drafter_lengths[req.slot]) == req.committed_length - req.drafter_lag
                assert 0 <= req.drafter_lag <= 4  # (a full lag is caught up at the next round)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert sum(catch_ups) >= 8 and engine.queued_rounds >= 30  # (39 rounds after the first token)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_rounds_with_no_graph_after_start_up_capture_are_queued_eagerly(pair, plain, method):
    """After start-up capture the graph cache is frozen: a plain round whose graph was not captured (here:
    none was) runs eagerly, with no capture to wait for, so it is queued like a graphed one; drafted
    rounds and catch-ups between them keep plain decoding's tokens."""
    llm = queued_llm(pair, method, graphed=True)
    engine = llm.engine
    engine.runner.graphs.freeze()
    engine.policy = ScriptedNodes([max(engine.policy.ladder)] + [0] * 12)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    got = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    assert engine.queued_rounds > 20 and engine.runner.graphs.eager_runs > 20 and not engine.runner.graphs.keys


def test_queue_is_off_by_default_on_a_cpu(plain, pair):
    llm = LLM(str(pair.target), **ENGINE)
    assert not llm.engine.overlap.enabled
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.queued_rounds == 0
    assert torch.device(llm.engine.device).type == "cpu"


def test_a_declined_probe_keeps_the_rounds_queued(pair, plain, monkeypatch):
    """A neighbour probe falls due while the policy is settled on plain rounds: the next round's
    choice is made before the current round is read; a probe the engine declines (no captured
    graph, cannot win) becomes a plain round, queued like the others. (Modelled round times on a
    read-count clock, tests/support/clocks.py: the policy settles on plain rounds on every machine.)"""
    use_read_count_clock(monkeypatch)
    llm = queued_llm(pair, "ddtree", graphed=False)
    engine = llm.engine
    modelled_round_times(engine.policy, monkeypatch)
    monkeypatch.setattr(engine.runner, "has_graph", lambda rows, nodes: nodes == 0)  # as if trees had no graph
    monkeypatch.setattr(engine.policy, "worth_a_graph", lambda rows, nodes: False)
    declined = []
    real_decline = engine.policy.decline_probe
    monkeypatch.setattr(engine.policy, "decline_probe", lambda: (declined.append(engine.overlap.ahead), real_decline()))
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    got = llm.generate([PROMPTS[1]], params)
    assert got[0].token_ids == plain.generate([PROMPTS[1]], params)[0].token_ids
    assert len(declined) >= 2  # probes fell due and were declined ...
    assert engine.queued_rounds >= 0.85 * got[0].rounds  # ... and the rounds after exploration stayed queued
