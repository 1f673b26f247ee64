"""Tokenizer helpers: chat templates and the token ids that end a generation."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

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


def encode_prompt(tokenizer, prompt: str, add_special_tokens: bool = False) -> list[int]:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer: pass token ids (--prompt-ids) instead of text")
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


@dataclasses.dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation goes through the chat template (the names are transformers')."""

    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # leave the final (assistant) message open, to be continued
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's
    variables: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # more template variables (enable_thinking, ...)
    tools: tuple[Mapping[str, Any], ...] | None = None  # function tools, as transformers' templates read them


def template_reads_tools(tokenizer, options: ChatTemplateOptions = ChatTemplateOptions()) -> bool:
    """The chat template (the request's, or the tokenizer's) refers to ``tools``."""
    template = options.chat_template or getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def encode_chat(tokenizer, messages: Iterable[dict], options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
    """Apply the chat template (by default with the generation prompt); returns token ids."""
    messages = list(messages)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so chat is not available")
    if not messages:
        raise RequestError("messages is empty; give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
    if tokenizer.chat_template is None and options.chat_template is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if options.continue_final_message:
            text = text[:-1]
        return encode_prompt(tokenizer, text + ("assistant:" if options.add_generation_prompt else ""))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message, chat_template=options.chat_template,
        tokenize=True, **({"tools": list(options.tools)} if options.tools else {}), **options.variables)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
