"""Plain rounds (0 drafted nodes) take a short path without the root-only tree and its accept walk
(``DeviceRound._plain``, switched off by ``plain_fast_path=False``). It must leave everything as the general path does: the
tokens, the acceptance of the drafted rounds that follow (so the drafter saw the same context
features), the target's KV cache and the drafter's deferred features, whether the round writes
them through the feature sink (the fused norm) or returns them to be deferred."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import ScriptedNodes, one_thread, tiny_pair  # noqa: F401  (fixture)
from tests.support.workload import BLOCK, PROMPTS, VOCAB

ENGINE = dict(max_running=8, max_context=96, prefill_chunk=8, adaptive_spec=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("plain-round"), vocab=VOCAB, block_size=BLOCK)


def run(pair, method: str, fast: bool, sink: bool = True):
    draft = None if method == "none" else str(pair.drafter)
    # feature_sink=False: the short path defers the returned features
    llm = LLM(str(pair.target), spec=method, draft=draft, budget=6, plain_fast_path=fast, feature_sink=sink, **ENGINE)
    engine = llm.engine
    if method != "none":
        engine.policy = ScriptedNodes([0, 0, 2, 0, 3, 0, 0, 0])  # plain stretches between drafted rounds
    params = [SamplingParams(max_tokens=12 + 2 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(5)]
    outputs = llm.generate(PROMPTS[:5], params)
    lagging = None
    if method != "none":
        runner = engine.proposer.runner
        lagging = (runner.lagging.clone(), runner.cache.storage.clone())
    return outputs, engine.cache.storage.clone(), lagging


@pytest.mark.parametrize("method,sink", [("none", True), ("dflash", True), ("ddtree", True), ("ddtree", False)])
def test_plain_rounds_match_the_general_path(pair, method, sink):
    fast_out, fast_kv, fast_drafter = run(pair, method, fast=True, sink=sink)
    slow_out, slow_kv, slow_drafter = run(pair, method, fast=False)
    assert [o.token_ids for o in fast_out] == [o.token_ids for o in slow_out]
    assert [o.acceptance_lengths for o in fast_out] == [o.acceptance_lengths for o in slow_out]
    assert torch.equal(fast_kv, slow_kv)
    if method != "none":
        assert all(torch.equal(a, b) for a, b in zip(fast_drafter, slow_drafter))
        assert any(max(o.acceptance_lengths) > 1 for o in fast_out)  # drafted rounds did accept tokens
