"""Conversations -> token ids plus a per-token ``assistant_mask``, through the target's chat template.

The mask is True exactly on the tokens of assistant responses: the response text and the
end-of-turn token that closes it (the drafter must learn to predict it: generation stops
there), but not the template's role header nor what follows the end-of-turn token. Anchors
and labels are drawn only where the mask is True.

How: the full chat is rendered to text once; each assistant turn's character span is
``[len(render(messages[:i], generation prompt)), len(render(messages[:i+1])))``; the text is
tokenized once with offsets, and a token belongs to the turn when its first character does.
That holds for any template whose renders of a prefix are a prefix of the full render; a
conversation whose template breaks that is skipped (reported by ``encode_conversation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from flashtree.train.data import Conversation

FALLBACK_GENERATION_PROMPT = "assistant:"


class EncodedConversation(NamedTuple):
    conv_id: str
    input_ids: torch.Tensor  # [N] int64
    assistant_mask: torch.Tensor  # [N] bool, True on assistant-response tokens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def render(tokenizer, messages: Sequence[dict], generation_prompt: bool = False) -> str:
    """The chat template's text (a plain ``role: content`` layout when there is no template)."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + (FALLBACK_GENERATION_PROMPT if generation_prompt else "")
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)


def assistant_spans(tokenizer, messages: Sequence[dict], first: int = 0) -> tuple[str, list[tuple[int, int]]] | None:
    """(full text, character spans of the assistant turns from message ``first`` on), or None for
    a template whose prefix renders are not prefixes of the full render."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True)
        through = render(tokenizer, messages[:i + 1])
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            return None
        spans.append((len(before), len(through)))
    return full, spans


def token_mask(offsets: Sequence[tuple[int, int]], token_ids: Sequence[int], spans: Sequence[tuple[int, int]],
               end_of_turn_ids: frozenset[int], truncated_last: bool = False) -> list[bool]:
    """True for tokens starting inside a span, up to and including the span's first end-of-turn
    token (excluding it for a cut-off last turn: the template closed a turn the model did not)."""
    mask = [False] * len(token_ids)
    for n, (lo, hi) in enumerate(spans):
        for j, (start, _) in enumerate(offsets):
            if lo <= start < hi:
                if token_ids[j] in end_of_turn_ids:
                    mask[j] = not (truncated_last and n == len(spans) - 1)
                    break
                mask[j] = True
    return mask


def encode_conversation(tokenizer, conv: Conversation, max_len: int, end_of_turn_ids: frozenset[int]
                        ) -> EncodedConversation | None:
    """Token ids and assistant mask, cut to ``max_len`` tokens; None when the conversation has
    fewer than two assistant tokens within the cut (no anchor with a label) or a bad template."""
    rendered = assistant_spans(tokenizer, conv.messages, conv.train_from)
    if rendered is None:
        return None
    text, spans = rendered
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_len]
    offsets = list(enc["offset_mapping"])[:max_len]
    mask = token_mask(offsets, ids, spans, end_of_turn_ids, conv.truncated)
    if sum(mask) < 2:
        return None
    return EncodedConversation(conv.conv_id, torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def encode_all(tokenizer, convs: Sequence[Conversation], max_len: int, end_of_turn_ids: frozenset[int],
               progress: bool = False) -> list[EncodedConversation]:
    """Encode every conversation, dropping the unusable ones."""
    items = convs
    if progress:
        from tqdm import tqdm

        items = tqdm(convs, desc="tokenize", unit="conv", leave=False)
    out = []
    for conv in items:
        encoded = encode_conversation(tokenizer, conv, max_len, end_of_turn_ids)
        if encoded is not None:
            out.append(encoded)
    return out
