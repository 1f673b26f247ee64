"""An engine nobody refers to any more is freed at once, without a garbage-collector pass: its KV cache
and weights (device memory the collector does not see) go back when the last reference goes, so a
process that builds one engine after another (benchmarks, model swaps) never holds two."""

import gc
import weakref

import pytest

from flashtree import LLM, SamplingParams


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_a_dropped_engine_is_freed_without_a_collection(tmp_path, spec):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    drafted = {} if spec == "none" else dict(spec=spec, draft=str(pair.drafter))
    llm = LLM(str(pair.target), device="cpu", dtype="float32", max_running=2, max_context=128, prefix_caching=True,
              **drafted)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.model)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None and model() is None
    finally:
        gc.enable()
