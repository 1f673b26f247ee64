"""The scheduler's prefill budget: a step's prefill holds at most max_prefill_tokens padded prompt
tokens (oldest admitted first, at least one request) while running requests keep decoding, and the
budget is validated. (Outputs do not depend on it: tests/integration/test_prefill_budget.py.)"""

from __future__ import annotations

import pytest

from flashtree import SamplingParams
from flashtree.config import CacheConfig, SchedulerConfig
from flashtree.engine.request import Request, Status
from flashtree.engine.scheduler import Scheduler
from flashtree.errors import ConfigError


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


def test_the_prefill_budget_defaults_by_device_and_keeps_a_given_one():
    assert SchedulerConfig().max_prefill_tokens is None
    assert Scheduler(SchedulerConfig(), device_type="cpu").config.max_prefill_tokens == 256
    assert Scheduler(SchedulerConfig(), device_type="cuda").config.max_prefill_tokens == 2048
    assert Scheduler(SchedulerConfig(max_prefill_tokens=4096), device_type="cpu").config.max_prefill_tokens == 4096
