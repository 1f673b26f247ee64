"""The draft vocabulary (spec/draft_vocab.py, ``--draft-vocab N``): bad rankings or sizes get clear
errors, rankings count assistant turns, the default size by device and ranking, 0 turns a ranking
off, and the command lines pass it on. Drafting from it in the engine (lossless):
tests/integration/test_draft_vocab.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flashtree import LLM
from flashtree.config import SpeculationConfig
from flashtree.errors import CheckpointError, ConfigError
from flashtree.speculative.defaults import shipped_drafter
from flashtree.speculative.draft_vocab import (
    CPU_DEFAULT_SIZE,
    DRAFT_VOCAB_FILE,
    RANKING_KEY,
    default_size,
    load_draft_vocab,
)
from flashtree.train.data import Conversation
from flashtree.train.draft_vocab import assistant_tokens, rank_tokens
from tests.dflash_helpers import drafter_with_ranking, tiny_pair
from tests.support.workload import BLOCK, VOCAB

ENGINE = dict(max_running=4, max_context=96, prefill_chunk=8, adaptive_spec=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("vocab"), vocab=VOCAB, block_size=BLOCK)


def test_rankings_and_sizes_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=DRAFT_VOCAB_FILE):
        load_draft_vocab(tmp_path, 4, VOCAB)
    cases = [({"ids": torch.arange(4)}, "no tensor 'token_ids'"),
             ({RANKING_KEY: torch.arange(4, dtype=torch.int32)}, "1-D int64"),
             ({RANKING_KEY: torch.tensor([0, VOCAB])}, r"token ids must be in \[0, 24\)"),
             ({RANKING_KEY: torch.tensor([3, 1, 3])}, "repeats token ids")]
    for tensors, message in cases:
        save_file(tensors, str(tmp_path / DRAFT_VOCAB_FILE))
        with pytest.raises(CheckpointError, match=message):
            load_draft_vocab(tmp_path, 2, VOCAB)
    save_file({RANKING_KEY: torch.tensor([5, 2, 7])}, str(tmp_path / DRAFT_VOCAB_FILE))
    assert load_draft_vocab(tmp_path, 2, VOCAB).tolist() == [5, 2]
    with pytest.raises(ConfigError, match=r"--draft-vocab must be in \[1, 3\]"):
        load_draft_vocab(tmp_path, 4, VOCAB)
    assert load_draft_vocab(tmp_path, 8, VOCAB, at_most=True).tolist() == [5, 2, 7]  # a default size
    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigError, match="--draft-vocab must be an integer >= 0"):
            SpeculationConfig(method="ddtree", draft="d", draft_vocab=bad)
    with pytest.raises(ConfigError, match="--draft-vocab needs a drafter"):
        SpeculationConfig(draft_vocab=8)
    SpeculationConfig(draft_vocab=0)  # the whole vocabulary: nothing to restrict


def test_rank_tokens_counts_assistant_turns_most_frequent_first():
    class Chars:  # a tokenizer: one token per character, its code point
        @staticmethod
        def encode(text, add_special_tokens=False):
            return [ord(c) for c in text]

    conversations = [Conversation("a", ({"role": "user", "content": "zzzz"}, {"role": "assistant", "content": "bab"})),
                     Conversation("b", ({"role": "user", "content": "z"}, {"role": "assistant", "content": "cca"}))]
    tokens = assistant_tokens(Chars, conversations)
    assert tokens == [ord(c) for c in "babcca"]  # the user turns do not count
    assert rank_tokens(tokens) == [ord("a"), ord("b"), ord("c")]  # a, b twice (tie by id), c twice


def test_the_default_size_by_device_and_ranking(tmp_path):
    """16,384 on a CPU where the drafter ships a ranking (the shipped one does); none on CUDA or
    without a ranking; 0 asks for the whole vocabulary."""
    shipped = shipped_drafter("smollm2")
    assert load_draft_vocab(shipped, CPU_DEFAULT_SIZE, 49152).shape == (CPU_DEFAULT_SIZE,)
    assert default_size(None, torch.device("cpu"), shipped) == CPU_DEFAULT_SIZE
    assert default_size(None, torch.device("cuda"), shipped) is None
    assert default_size(None, torch.device("cpu"), tmp_path) is None
    assert default_size(0, torch.device("cpu"), shipped) is None
    assert default_size(300, torch.device("cuda"), tmp_path) == 300


def test_zero_turns_a_ranking_off(pair, tmp_path):
    draft = drafter_with_ranking(pair, tmp_path, list(range(VOCAB - 1, -1, -1)))
    llm = LLM(str(pair.target), spec="ddtree", draft=draft, budget=6, draft_vocab=0, **ENGINE)
    assert llm.engine.proposer.runner.vocab_ids is None
    llm = LLM(str(pair.target), spec="ddtree", draft=draft, budget=6, **ENGINE)  # the CPU default: all it ranks
    assert llm.engine.proposer.runner.vocab_ids.tolist() == list(range(VOCAB - 1, -1, -1))


def test_the_command_lines_pass_it_on():
    from flashtree.cli import build_parser
    from flashtree.cli.bench import setup_from_args
    from flashtree.cli.serve import config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve", "--draft-vocab", "8192"])).engine.speculation.draft_vocab == 8192
    bench = parser.parse_args(["bench", "--draft-vocab", "0", "--methods", "ar,ddtree:4"])
    assert setup_from_args(bench, needs_draft=True).engine.speculation.draft_vocab == 0
    assert parser.parse_args(["generate", "--prompt", "x", "--draft-vocab", "100"]).draft_vocab == 100
