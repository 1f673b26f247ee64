"""A step's prefill holds at most max_prefill_tokens padded prompt tokens (oldest admitted first,
at least one request), running requests keep decoding meanwhile, and outputs do not depend on
the budget (greedy and seeded, plain and DDTree)."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.config import CacheConfig, SchedulerConfig
from flashtree.engine.request import Request, Status
from flashtree.engine.scheduler import Scheduler
from flashtree.errors import ConfigError
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401  (fixture)
from tests.test_dflash_lossless import BLOCK, PROMPTS, VOCAB


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


def request(length: int) -> Request:
    return Request(prompt_ids=list(range(1, length + 1)), params=SamplingParams(max_tokens=4))


def test_prefill_batch_fits_the_budget_oldest_first():
    scheduler = Scheduler(SchedulerConfig(max_running=4, prefill_chunk=4, max_prefill_tokens=8), CacheConfig(max_context=64))
    reqs = [request(n) for n in (10, 3, 7, 2)]
    for req in reqs:
        scheduler.add(req)
    step = scheduler.schedule()
    assert step.prefill == reqs[:2]  # 2 x 4 padded tokens; a third would need 12
    for req in step.prefill:
        req.prefilled += min(4, len(req.prompt_ids) - req.prefilled)
    reqs[1].status = Status.RUNNING  # its prompt is in
    step = scheduler.schedule()
    assert step.prefill == [reqs[0], reqs[2]] and step.decode == [reqs[1]]


def test_one_request_always_prefills_and_the_budget_is_validated():
    scheduler = Scheduler(SchedulerConfig(max_running=2, prefill_chunk=16, max_prefill_tokens=4), CacheConfig(max_context=64))
    first, second = request(30), request(30)
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule().prefill == [first]  # over budget alone, but progress is guaranteed
    with pytest.raises(ConfigError):
        SchedulerConfig(max_prefill_tokens=0)


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
