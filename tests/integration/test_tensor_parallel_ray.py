"""``--distributed-executor ray``: the tensor-parallel workers as Ray actors in a placement group on a
local Ray cluster (``ray.init(num_cpus=2)``), gloo between them: 2 ranks give the single-process
engine's greedy tokens and acceptance lengths (plain, DFlash, DDTree), the placement group is removed
when the engine closes, and a killed actor makes the engine raise TensorParallelError naming its rank.
Skipped without Ray (the optional extra ``flashtree[ray]``)."""

from __future__ import annotations

import os
import signal

import pytest

ray = pytest.importorskip("ray")

from flashtree import LLM, SamplingParams
from flashtree.engine.tp_executor import TensorParallelError
from tests.dflash_helpers import tiny_pair
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB

METHODS = {"plain": {"spec": "none"}, "dflash": {"spec": "dflash"}, "ddtree": {"spec": "ddtree", "budget": 8}}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ray"), vocab=VOCAB, block_size=BLOCK)


def settings(pair, method: str) -> dict:
    spec = METHODS[method]
    return {**ENGINE, **spec, **({} if spec["spec"] == "none" else {"draft": str(pair.drafter)})}


@pytest.mark.parametrize("method", list(METHODS))
def test_ray_actors_give_the_single_process_tokens(cluster, pair, method):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = LLM(str(pair.target), **settings(pair, method)).generate(PROMPTS, params)
    parallel = LLM(str(pair.target), tensor_parallel_size=2, distributed_executor="ray", **settings(pair, method))
    try:
        got = parallel.generate(PROMPTS, params)
    finally:
        parallel.engine.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.acceptance_lengths for o in got] == [o.acceptance_lengths for o in expected]
    groups = ray.util.placement_group_table().values()
    assert groups and all(group["state"] == "REMOVED" for group in groups)


def test_a_killed_actor_raises_naming_its_rank(cluster, pair):
    llm = LLM(str(pair.target), tensor_parallel_size=2, distributed_executor="ray", worker_timeout_s=20.0,
              **settings(pair, "plain"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    try:
        llm.generate(PROMPTS[:2], params)
        os.kill(llm.engine.executor.workers[0].process.pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate(PROMPTS[:2], params)
    finally:
        llm.engine.close()
