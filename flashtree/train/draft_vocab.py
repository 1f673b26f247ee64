"""Write a drafter's token ranking (``speculative/draft_vocab.py``): every token id of the training
split's assistant turns, most frequent first (ties by id), as ``draft_vocab.safetensors``.

    python -m flashtree.train.draft_vocab --model smollm2 --out DRAFTER_DIR [--data sharegpt]

Only the training split counts (``data.split_conversations``), so held-out answers never shape it.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from flashtree.speculative.draft_vocab import DRAFT_VOCAB_FILE, RANKING_KEY
from flashtree.train.data import (
    SHAREGPT,
    Conversation,
    load_conversations,
    split_conversations,
)


def assistant_tokens(tokenizer, conversations: Iterable[Conversation]) -> list[int]:
    """The token ids of the conversations' assistant turns, in order (no special tokens)."""
    return [token for conv in conversations for message in conv.messages if message["role"] == "assistant"
            for token in tokenizer.encode(message["content"], add_special_tokens=False)]


def rank_tokens(tokens: Iterable[int]) -> list[int]:
    """The distinct ``tokens``, most frequent first, ties by id."""
    counts = collections.Counter(tokens)
    return [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def write_ranking(ranking: Sequence[int], out_dir: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(out_dir) / DRAFT_VOCAB_FILE
    save_file({RANKING_KEY: torch.tensor(list(ranking), dtype=torch.int64)}, str(path))
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="the target whose tokenizer counts the tokens")
    parser.add_argument("--data", default=SHAREGPT, help="'sharegpt' or a JSONL file of chat messages")
    parser.add_argument("--out", type=Path, required=True, help="the drafter's directory")
    args = parser.parse_args(argv)
    from flashtree.models.loader import load_checkpoint, load_tokenizer

    tokenizer = load_tokenizer(load_checkpoint(args.model).path)
    train, _ = split_conversations(load_conversations(args.data))
    path = write_ranking(rank_tokens(assistant_tokens(tokenizer, train)), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
