"""Qwen3-MoE targets: a checkpoint saved by transformers (per-expert tensors) loads, decodes the
tokens transformers' generate gives, and every speculative method is lossless on it, greedy and
sampled, at several batch sizes."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("moe"), family="qwen3_moe", vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


def test_the_checkpoint_loads_as_a_moe_and_decodes_as_transformers(pair, plain):
    layers = plain.engine.model.model.layers
    assert type(layers[0].mlp).__name__ == "SparseMoE" and type(layers[1].mlp).__name__ == "MLP"  # mlp_only_layers
    assert len(layers[0].mlp.experts) == 6 and layers[0].mlp.normalize
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:4], plain.generate(PROMPTS[:4], params)):
        with torch.no_grad():
            ref = pair.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_speculation_on_a_moe_target_gives_the_plain_tokens(pair, plain, method, temperature, rows):
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=temperature, seed=i) for i in range(rows)]
    prompts = PROMPTS[:rows]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=8, **ENGINE)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
