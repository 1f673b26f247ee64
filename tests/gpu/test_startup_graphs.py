"""CUDA only: the engine captures its round graphs at start-up and none while serving, and its tokens
are those of plain decoding; rounds without a start-up graph (log-probabilities) run eagerly."""

import pytest
import torch

from flashtree import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [list(range(2, 20)), [5, 6], list(range(3, 12)) * 2, [7] * 9, [1, 2, 3], list(range(4, 17)),
           [9, 8, 7, 6], [2] * 5]


@pytest.mark.parametrize("spec,adaptive,packed", [("none", True, None), ("dflash", False, None), ("ddtree", False, None),
                                                 ("ddtree", True, None), ("ddtree", True, True)])
def test_no_capture_while_serving(tmp_path, spec, adaptive, packed):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    common = dict(device="cuda", dtype="float32", max_running=8, max_context=256)
    plain = LLM(str(pair.target), cuda_graphs=False, **common)
    drafted = dict(spec=spec, draft=str(pair.drafter), budget=8) if spec != "none" else {}
    llm = LLM(str(pair.target), adaptive_spec=adaptive, packed_verify=packed, **drafted, **common)
    engine = llm.engine
    assert engine.runner.graphs.frozen and engine.runner.graphs.captures > 0 and engine.graph_capture_seconds > 0
    for params in (SamplingParams(max_tokens=30, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True)):
        for rows in (1, 3, 8):  # padded to 1, 4 and 8 rows
            want = [o.token_ids for o in plain.generate(PROMPTS[:rows], params)]
            assert [o.token_ids for o in llm.generate(PROMPTS[:rows], params)] == want, (params, rows)
    assert engine.graph_counts == (0, 0)
    replays, replay_seconds = engine.graph_replays  # every round above replayed a start-up graph
    assert replays > 0 and replay_seconds > 0.0
    with_logprobs = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    want = [o.token_ids for o in plain.generate(PROMPTS[:2], with_logprobs)]
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], with_logprobs)] == want
    captures, eager = engine.graph_counts
    assert captures == 0 and eager > 0


def test_lazy_capture_when_asked(tmp_path):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    llm = LLM(str(pair.target), device="cuda", dtype="float32", max_running=4, max_context=256,
              cuda_graph_max_tokens=None)
    assert not llm.engine.runner.graphs.frozen and llm.engine.runner.graphs.captures == 0
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.graph_counts[0] > 0


@pytest.mark.parametrize("exact", [False, True])
def test_no_kernel_is_compiled_while_serving(tmp_path, exact):
    """Start-up warms up the prefill kernels (engine/warm_up.py): prompts of assorted lengths, alone, together
    and in chunks, load no Triton kernel afterwards. (A vocabulary no other test uses: the LM head's products are
    new to this process.)"""
    triton = pytest.importorskip("triton")
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=48, block_size=5)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, device="cuda", dtype="bfloat16",
              exact=exact, max_running=16, max_context=512, prefill_chunk=128)
    assert llm.engine.warm_up_seconds > 0
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 48, (n,), generator=gen).tolist()
               for n in (1, 2, 6, 11, 16, 23, 37, 48, 64, 77, 100, 129, 150, 200, 256, 300)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    loads = []
    hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kwargs: loads.append(kwargs.get("repr")) or False
    try:
        for prompt in prompts:
            llm.generate([prompt], params)
        llm.generate(prompts, params)
        llm.generate(prompts[3:8], params)
    finally:
        triton.knobs.runtime.jit_cache_hook = hook
    assert loads == []
