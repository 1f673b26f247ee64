"""The start-up warm-up (engine/warm_up.py): which prefill steps it runs, and that running them (forced on a
CPU, where it is off by default) leaves the engine's pages and tokens as they were."""

import pytest

from flashtree import LLM, SamplingParams
from flashtree.config import KernelConfig
from flashtree.engine.prefill import Prefill
from flashtree.engine.warm_up import warm_up_rows, warm_up_steps, warm_up_widths
from flashtree.errors import ConfigError


def test_widths_meet_one_two_three_and_each_power_of_two_with_its_neighbours():
    assert warm_up_widths(1) == [1]
    assert warm_up_widths(16) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16]
    assert warm_up_widths(40) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40]
    widths = warm_up_widths(512)
    assert {w % 16 == 0 for w in widths if w > 16} == {True, False} and max(widths) == 512
    with pytest.raises(ValueError, match="longest must be >= 1"):
        warm_up_widths(0)


def test_rows_are_one_two_and_the_most_a_step_holds():
    assert warm_up_rows(1, max_rows=64, max_tokens=2048) == [1, 2, 64]
    assert warm_up_rows(512, max_rows=64, max_tokens=2048) == [1, 2, 4]
    assert warm_up_rows(512, max_rows=1, max_tokens=2048) == [1]
    assert warm_up_rows(300, max_rows=8, max_tokens=256) == [1]  # (a chunk wider than the step: one row)
    steps = warm_up_steps(16, max_rows=3, max_tokens=40)
    assert steps[0] == (16, 2) and (1, 3) in steps and (16, 3) not in steps
    assert [w * r for w, r in steps] == sorted((w * r for w, r in steps), reverse=True)


def test_warm_up_leaves_pages_and_tokens_alone(tmp_path, monkeypatch):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=32, block_size=6)
    prompts = [list(range(2, 20)), [5, 6, 7], list(range(3, 30))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", max_running=3, max_context=128, prefill_chunk=16,
                  max_prefill_tokens=40, spec="ddtree", draft=str(pair.drafter), budget=8, adaptive_spec=False)
    cold = LLM(str(pair.target), **common)
    assert cold.engine.warm_up_seconds == 0.0  # (off on a CPU by default)
    want = [o.token_ids for o in cold.generate(prompts, params)]
    steps = []
    call = Prefill.__call__
    monkeypatch.setattr(Prefill, "__call__", lambda self, rows, chunk, defer=None: steps.append(
        (chunk, len(rows))) or call(self, rows, chunk, defer))
    warm = LLM(str(pair.target), warm_up=True, **common)
    assert steps == warm_up_steps(16, max_rows=3, max_tokens=40) and warm.engine.warm_up_seconds > 0
    assert warm.engine.pages.pool.free_pages == cold.engine.pages.pool.free_pages
    assert int(warm.engine.cache.lengths.abs().sum()) == 0
    assert [o.token_ids for o in warm.generate(prompts, params)] == want


def test_warm_up_is_on_off_or_by_device():
    assert KernelConfig().warm_up is None
    with pytest.raises(ConfigError, match="warm_up must be True, False or None"):
        KernelConfig(warm_up="yes")
