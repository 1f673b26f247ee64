"""CUDA only: the paged KV cache with CUDA graphs, the Triton attention and tree kernels, small
and odd page sizes, a small pool and prefix caching gives the plain tokens; a pool sized by
gpu_memory_utilization fills the device to about that fraction."""

import pytest
import torch

from flashtree import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("triton_attention", [None, False, True])
@pytest.mark.parametrize("spec,page_size", [("none", 5), ("dflash", 16), ("ddtree", 4), ("ddtree", 16)])
def test_paged_graphed_rounds_equal_plain(tmp_path, spec, page_size, triton_attention):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=6)
    shared = list(range(2, 20)) * 3
    prompts = [shared + [1, 2, 3], list(range(2, 20)), shared + [7] * 9, [5, 6]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_running=4, max_context=256)
    plain = [o.token_ids for o in LLM(str(pair.target), **common).generate(prompts, params)]
    drafted = dict(spec=spec, draft=str(pair.drafter), budget=8) if spec != "none" else {}
    llm = LLM(str(pair.target), page_size=page_size, kv_pages=64, prefix_caching=True, triton_attention=triton_attention,
              triton_tree=True, **drafted, **common)
    got = [llm.generate([p], params)[0].token_ids for p in prompts]  # one by one: later ones hit the cache
    assert got == plain
    assert llm.engine.runner.graphs is not None and llm.engine.prefix_cache.hit_tokens > 0


def test_gpu_memory_utilization_sizes_the_pool(tmp_path):
    from tests.helpers import tiny_hf_model

    tiny_hf_model("qwen3_qknorm").save_pretrained(tmp_path)
    free, total = torch.cuda.mem_get_info()
    target = (total - free) / total + 0.05  # 5% of the device for pages
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", gpu_memory_utilization=target, max_context=256)
    free_after, _ = torch.cuda.mem_get_info()
    used = (total - free_after) / total
    assert llm.engine.pages.pool.num_pages > 1000 and abs(used - target) < 0.01
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_pool_leaves_room_for_the_widest_rounds(tmp_path):
    """A DDTree engine sized by gpu_memory_utilization stays within that fraction through start-up's
    captures and wide sampled rounds with log-probabilities (the activation reserve,
    engine/memory_profile.py). Its widest rounds need about 6.5 GiB (64 rows x 33 tokens x 32,000 logits,
    sorted for top-p, in the graphs' pool and again eagerly): 10% of the device leaves them room and pages."""
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=32000, block_size=16)
    free, total = torch.cuda.mem_get_info()
    target = (total - free) / total + 0.1
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=32, adaptive_spec=False, device="cuda",
              dtype="bfloat16", gpu_memory_utilization=target, max_context=512, max_running=64)
    reserve = llm.engine.activation_reserve
    assert reserve.widest_round > 64 * 33 * 32000 * 4 and reserve.graphed_round > 0
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.9, logprobs=2, seed=1)
    outs = llm.generate([[1 + i % 30, 2, 3] for i in range(64)], params)
    assert all(len(o.token_ids) == 32 for o in outs)
    free_after, _ = torch.cuda.mem_get_info()
    assert (total - free_after) / total <= target + 0.002
