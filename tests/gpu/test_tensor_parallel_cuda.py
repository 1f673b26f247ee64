"""Two or more CUDA devices: tensor parallelism over NCCL (the Triton kernels, the Triton tree commit on
every rank) gives the single-device tokens in fp32; a killed worker raises a TensorParallelError.
(bf16 is left out: the all-reduce sums the ranks' partial outputs in another order than one device's
product, and NCCL's order may depend on the message size, so exact mode's invariance does not hold
under TP yet.)"""

import os
import signal

import pytest
import torch

from flashtree import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")

PROMPTS = [[1, 5, 7], list(range(3, 20)), [9], [4, 4, 8, 8, 2, 2]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.dflash_helpers import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("tp-cuda"), vocab=24, block_size=6)


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_two_devices_give_the_single_device_tokens(pair, spec):
    common = {"device": "cuda", "dtype": "float32", "max_running": 4, "max_context": 128, "adaptive_spec": False}
    if spec != "none":
        common.update(spec=spec, draft=str(pair.drafter), budget=8)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = LLM(str(pair.target), **common).generate(PROMPTS, params)
    parallel = LLM(str(pair.target), tensor_parallel_size=2, **common)
    try:
        got = parallel.generate(PROMPTS, params)
    finally:
        parallel.engine.executor.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_killed_worker_raises(pair):
    from flashtree.engine.tp_executor import TensorParallelError

    llm = LLM(str(pair.target), device="cuda", dtype="float32", tensor_parallel_size=2, worker_timeout_s=10.0,
              max_context=128)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    os.kill(llm.engine.executor.workers[0].process.pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
