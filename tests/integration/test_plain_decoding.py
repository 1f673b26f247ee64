"""Batched plain decoding through the engine: equals rows decoded alone and transformers generate."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.helpers import tiny_hf_model
from tests.support.clocks import use_read_count_clock

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 9, 9, 9], list(range(20, 45))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = tiny_hf_model("llama_gqa")
    hf.save_pretrained(path)
    return hf, LLM(str(path), max_running=4, max_context=128, prefill_chunk=8)


def test_batched_greedy_equals_alone_and_transformers(tiny):
    hf, llm = tiny
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)  # 5 prompts > 4 slots: one waits, prompts are chunked
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.finish_reason == "length" and len(out.token_ids) == 16


def test_stop_token_and_max_tokens(tiny):
    _, llm = tiny
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop_at = free[5]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    first = free.index(stop_at)
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    _, llm = tiny
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=30, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    batched = llm.generate([PROMPTS[0], PROMPTS[2]], params)[0].token_ids
    assert alone == batched
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=8,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_step_trace_accounts_for_every_step(tiny, tmp_path, monkeypatch):
    """``trace_steps``: one line per engine step; its parts add up, rounds and prefills are where
    the engine ran them, and benchmarks/step_trace_summary.py reads the file. The engine's clock
    counts its reads (tests/support/clocks.py): the traced times are the same on every machine."""
    import json
    import sys
    from pathlib import Path

    hf, _ = tiny
    hf.save_pretrained(tmp_path / "model")
    use_read_count_clock(monkeypatch)
    trace = tmp_path / "steps.jsonl"
    llm = LLM(str(tmp_path / "model"), max_running=4, max_context=128, prefill_chunk=8, trace_steps=str(trace))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = [o.token_ids for o in LLM(str(tmp_path / "model"), max_running=4, max_context=128,
                                          prefill_chunk=8).generate(PROMPTS, params)]
    steps = 0
    real_step = llm.engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return real_step()

    llm.engine.step = counting_step
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference  # tracing changes no token
    llm.engine.step_tracer.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == steps
    assert sum(line["round_ms"] is not None for line in lines) == sum(llm.engine.rounds_by_nodes.values())
    assert sum(line["prefill_rows"] for line in lines) >= len(PROMPTS)  # (long prompts take several chunks)
    for line in lines:
        assert (line["round_ms"] is None) == (line["rows"] == 0) == (line["nodes"] is None)
        assert (line["prefill_ms"] is None) == (line["prefill_rows"] == 0)
        assert line["step_ms"] >= (line["round_ms"] or 0) + (line["prefill_ms"] or 0)
    assert lines[0]["gap_ms"] is None and all(line["gap_ms"] >= 0 for line in lines[1:])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from step_trace_summary import summarize

    passes = summarize(trace, gap_s=60.0, min_rounds=1)
    assert len(passes) == 1 and passes[0]["rounds"] == sum(llm.engine.rounds_by_nodes.values())
