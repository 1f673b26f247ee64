"""Outputs do not depend on the prefill budget (max_prefill_tokens: greedy and seeded, plain and
DDTree). (The scheduler's budget rules: tests/unit/test_prefill_budget.py.)"""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401  (fixture)
from tests.support.workload import BLOCK, PROMPTS, VOCAB


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("prefill"), vocab=VOCAB, block_size=BLOCK)


@pytest.mark.parametrize("method", ["none", "ddtree"])
def test_outputs_do_not_depend_on_the_prefill_budget(pair, method):
    draft = None if method == "none" else str(pair.drafter)
    engines = [LLM(str(pair.target), spec=method, draft=draft, budget=8, max_running=8, max_context=96,
                   prefill_chunk=4, max_prefill_tokens=budget, adaptive_spec=False) for budget in (4, 10_000)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(len(PROMPTS))]
    tight, loose = (llm.generate(PROMPTS, params) for llm in engines)
    assert [o.token_ids for o in tight] == [o.token_ids for o in loose]
