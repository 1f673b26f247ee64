"""The draft vocabulary in the engine (spec/draft_vocab.py, ``--draft-vocab N``): the drafter
proposes only the N first tokens of its ranking, decoding stays exactly plain decoding's, and the
whole vocabulary in order gives the unrestricted drafter's trees. Rankings, sizes and defaults:
tests/unit/test_draft_vocab.py."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.speculative.tree import ROOT
from tests.dflash_helpers import drafter_with_ranking, tiny_pair
from tests.support.workload import BLOCK, PROMPTS, VOCAB

ENGINE = dict(max_running=4, max_context=96, prefill_chunk=8, adaptive_spec=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("vocab"), vocab=VOCAB, block_size=BLOCK)


def generate(pair, method: str, draft=None, draft_vocab=None, params=None):
    llm = LLM(str(pair.target), spec=method, draft=draft or (None if method == "none" else str(pair.drafter)),
              budget=6, draft_vocab=draft_vocab, **ENGINE)
    params = params or SamplingParams(max_tokens=20, ignore_eos=True)
    return llm, llm.generate(PROMPTS[:4], params)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_the_whole_vocabulary_in_order_drafts_as_without_one(pair, tmp_path, method):
    """Draft indices are then token ids and the head's rows are the lm_head's: the same trees
    (acceptance lengths) and tokens as the unrestricted drafter."""
    draft = drafter_with_ranking(pair, tmp_path, list(range(VOCAB)))
    _, restricted = generate(pair, method, draft, draft_vocab=VOCAB)
    _, whole = generate(pair, method)
    assert [o.token_ids for o in restricted] == [o.token_ids for o in whole]
    assert [o.acceptance_lengths for o in restricted] == [o.acceptance_lengths for o in whole]


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_a_restricted_vocabulary_drafts_from_it_and_stays_lossless(pair, tmp_path, method):
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()
    allowed = set(ranking[:VOCAB // 2])
    draft = drafter_with_ranking(pair, tmp_path, ranking)
    llm = LLM(str(pair.target), spec=method, draft=draft, budget=6, draft_vocab=VOCAB // 2, **ENGINE)
    drafted = []
    real = llm.engine.proposer.propose

    def spy(rows, nodes):
        tree = real(rows, nodes)
        nodes_axis = torch.arange(tree.tokens.shape[1])
        drafted.extend(tree.tokens[tree.valid & (nodes_axis != ROOT)].tolist())
        return tree

    llm.engine.proposer.propose = spy
    _, plain = generate(pair, "none")
    greedy = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in plain]
    assert drafted and set(drafted) <= allowed
    seeded = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=11)
    _, plain_sampled = generate(pair, "none", params=seeded)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], seeded)] == [o.token_ids for o in plain_sampled]
