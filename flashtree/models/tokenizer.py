"""Tokenizer helpers: chat templates and the token ids that end a generation."""

from __future__ import annotations

from typing import Iterable

from flashtree.errors import RequestError
from flashtree.models.config import ModelConfig

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


def stop_token_ids_for(config: ModelConfig, tokenizer) -> set[int]:
    """eos ids from the config and tokenizer, plus the chat template's end-of-turn tokens."""
    ids = set(config.eos_token_ids)
    if tokenizer is None:
        return ids
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer: pass token ids (--prompt-ids) instead of text")
    return tokenizer.encode(prompt, add_special_tokens=False)


def encode_chat(tokenizer, messages: Iterable[dict]) -> list[int]:
    """Apply the tokenizer's chat template with the generation prompt; returns token ids."""
    messages = list(messages)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so chat is not available")
    if not messages:
        raise RequestError("messages is empty; give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
    if tokenizer.chat_template is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return encode_prompt(tokenizer, text)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
