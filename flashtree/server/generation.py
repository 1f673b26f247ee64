"""An OpenAI request -> what the engine takes: prompt token ids, SamplingParams, DDTree budget.

Tokenization runs on the event loop with the HTTP side's own tokenizer copy (the engine
thread decodes with the original; a Rust tokenizer must not be shared across threads).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from flashtree.engine.engine import LLMEngine
from flashtree.errors import RequestError
from flashtree.models.tokenizer import encode_chat, encode_prompt
from flashtree.sampling import SamplingParams
from flashtree.server.errors import APIError, param_named_in
from flashtree.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the loaded model."""

    name: str
    max_context: int
    vocab_size: int
    tokenizer: Any  # None when the checkpoint has no tokenizer (token-id prompts only)

    @classmethod
    def of(cls, engine: LLMEngine, name: str) -> "ServedModel":
        tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        return cls(name, engine.config.cache.max_context, engine.model.config.vocab_size, tokenizer)


@dataclasses.dataclass(frozen=True)
class GenerationInput:
    prompt_ids: list[int]
    params: SamplingParams
    budget: int | None


def chat_input(body: ChatCompletionRequest, model: ServedModel) -> GenerationInput:
    messages = [m.as_template_dict() for m in body.messages]
    prompt_ids = _tokenize(lambda: encode_chat(model.tokenizer, messages), "messages")
    max_tokens = body.max_new_tokens or max(1, model.max_context - len(prompt_ids))
    return GenerationInput(prompt_ids, sampling_params(body, max_tokens, "messages"), body.budget)


def completion_input(body: CompletionRequest, model: ServedModel) -> GenerationInput:
    if isinstance(body.prompt, str):
        prompt_ids = _tokenize(lambda: encode_prompt(model.tokenizer, body.prompt), "prompt")
    else:
        prompt_ids = list(body.prompt)
        bad = [t for t in prompt_ids if t >= model.vocab_size]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is out of range; the vocabulary has "
                                f"{model.vocab_size} tokens (ids 0..{model.vocab_size - 1})", param="prompt")
    return GenerationInput(prompt_ids, sampling_params(body, body.max_tokens, "prompt"), body.budget)


def sampling_params(body: SamplingRequest, max_tokens: int, prompt_field: str) -> SamplingParams:
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                              max_tokens=max_tokens, stop=body.stop_strings, seed=body.seed,
                              ignore_eos=body.ignore_eos)
    except RequestError as err:
        raise APIError(400, str(err), param=param_named_in(str(err), prompt_field)) from None


def _tokenize(encode, field: str) -> list[int]:
    try:
        return list(encode())
    except RequestError as err:
        raise APIError(400, str(err), param=field) from None
    except Exception as err:  # chat templates raise their own errors (e.g. on role order)
        raise APIError(400, f"{field}: cannot apply the chat template ({type(err).__name__}: {err})",
                       param=field) from None
