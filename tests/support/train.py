"""Fixtures for the training tests: a tiny deterministic "successor" target, chats in JSONL,
and a truncated ShareGPT-like JSON file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.dflash_helpers import save_tiny_tokenizer

SUCCESSOR_VOCAB = 48
WORD_IDS = range(15, SUCCESSOR_VOCAB - 2)  # the tokenizer's "w0".."w30" (see save_tiny_tokenizer)


def save_successor_target(path: Path, cycle: int = 8, hidden: int = 64, layers: int = 4) -> tuple[Path, list[int]]:
    """A Llama whose greedy next token depends only on the current token: the words
    ``w0..w{cycle-1}`` follow each other in a cycle and every other token is followed by ``w0``.

    Embeddings are one-hot, every attention and MLP output is zero (the residual stream keeps
    the one-hot), and the lm_head is the successor matrix. Returns (directory, cycle ids)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=SUCCESSOR_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = list(WORD_IDS)[:cycle]
    successor = {t: ids[0] for t in range(SUCCESSOR_VOCAB)}
    successor.update({t: ids[(i + 1) % cycle] for i, t in enumerate(ids)})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :SUCCESSOR_VOCAB] = torch.eye(SUCCESSOR_VOCAB)
        model.lm_head.weight.zero_()
        for t, nxt in successor.items():
            model.lm_head.weight[nxt, t] = 4.0
    model.save_pretrained(path)
    save_tiny_tokenizer(path, SUCCESSOR_VOCAB)
    return path, ids


def word(i: int) -> str:
    return f"w{i}"


def successor_chats(path: Path, count: int, cycle: int, seed: int = 0, min_len: int = 24, max_len: int = 48) -> Path:
    """JSONL chats: random user words; the assistant continues the successor cycle from a random word."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(count):
            user = " ".join(word(rng.randrange(31)) for _ in range(rng.randint(2, 6)))
            start = rng.randrange(cycle)
            answer = " ".join(word((start + k) % cycle) for k in range(rng.randint(min_len, max_len)))
            handle.write(json.dumps({"id": f"chat{i}", "messages": [{"role": "user", "content": user},
                                                                    {"role": "assistant", "content": answer}]}) + "\n")
    return path


def truncated_sharegpt(path: Path, records: list[dict], cut_chars: int = 40) -> Path:
    """A ShareGPT-style JSON array written out, then cut ``cut_chars`` before its end."""
    text = json.dumps(records, indent=2)
    path.write_text(text[:-cut_chars])
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny target and drafter the training tests use (vocabulary 32, 3 target layers, block 4)."""
    from tests.dflash_helpers import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("pair"), vocab=32, target_layers=3, block_size=4)
