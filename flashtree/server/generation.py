"""An OpenAI request -> what the engine takes: prompt token ids, SamplingParams, DDTree budget.

Tokenization runs off the event loop, on the server's one tokenizing thread (``ServerContext``), with
the HTTP side's own tokenizer copy (the engine thread decodes with the original; a Rust tokenizer must not be
shared across threads): a huge prompt then delays only other requests' tokenization, never a stream.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from pydantic import BaseModel

from flashtree.engine.engine import LLMEngine
from flashtree.errors import RequestError
from flashtree.grammar.backends import LazyGrammars
from flashtree.models.tokenizer import (
    ChatTemplateOptions,
    encode_chat,
    encode_prompt,
    template_reads_tools,
)
from flashtree.sampling import SamplingParams
from flashtree.server.errors import APIError, param_named_in
from flashtree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from flashtree.server.structured_fields import requested
from flashtree.server.tools import ToolPlan, tool_plan
from flashtree.structured import StructuredOutput


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of a loaded engine, in a form that crosses a process boundary."""

    max_context: int
    vocab_size: int
    tokenizer: Any  # a copy of the engine's (None when the checkpoint has none)
    stop_token_ids: frozenset[int]  # the model's own stop tokens (what a grammar may end with)
    grammar_backend: str
    method: str  # the decoding method's name
    device: str
    dtype: str

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        return cls(engine.config.cache.max_context, engine.model.config.vocab_size, tokenizer,
                   frozenset(engine.default_stop_ids), engine.config.scheduler.grammar_backend,
                   engine.proposer.name, str(engine.device), str(engine.dtype))


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the loaded model."""

    name: str
    max_context: int
    vocab_size: int
    tokenizer: Any  # None when the checkpoint has no tokenizer (token-id prompts only)
    # compiles a request's structured output, raising a RequestError for one that does not compile
    # (the engine's compiler when the engine shares this process: its cache then serves the engine
    # thread; an engine process compiles the request again); None: no structured output
    compile_structured: Callable[[StructuredOutput], object] | None = None  # (what it returns is unused)

    @classmethod
    def of(cls, info: EngineInfo, name: str, compile_structured: Callable | None = None) -> "ServedModel":
        """``compile_structured``: the engine's own compiler, or None for one of this side's own."""
        if compile_structured is None:  # (the engine process's twin, made here at the first structured request)
            compile_structured = LazyGrammars(info.tokenizer, info.vocab_size, info.stop_token_ids,
                                              info.grammar_backend).matcher
        return cls(name, info.max_context, info.vocab_size, info.tokenizer, compile_structured)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"{field}: token id {bad[0]} is out of range; the vocabulary has "
                                f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})", param=field)


@dataclasses.dataclass(frozen=True)
class GenerationInput:
    prompt_ids: list[int]
    params: SamplingParams
    budget: int | None
    echo: str = ""  # text the answer starts with (completions' echo: the prompt)
    tools: ToolPlan | None = None  # chat with tools: how the answer is read (server/tools.py)
    speculation: bool = False  # the stream carries the rounds and draft trees (the playground)

    def choice(self, index: int) -> "GenerationInput":
        """The input of choice ``index`` of an n > 1 request: its seed, when the request gave one, is
        the seed + index (each choice samples on its own)."""
        if index == 0 or self.params.seed is None:
            return self
        return dataclasses.replace(self, params=dataclasses.replace(self.params, seed=self.params.seed + index))


def chat_input(body: ChatCompletionRequest, model: ServedModel) -> GenerationInput:
    messages = [m.as_template_dict() for m in body.messages]
    plan = tool_plan([t.model_dump() for t in body.tools or ()],
                     body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice,
                     body.parallel_tool_calls)
    options = ChatTemplateOptions(add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  chat_template=body.chat_template, variables=body.chat_template_kwargs or {})
    messages, options = with_tools(messages, plan, options, model)
    prompt_ids = truncated(_tokenize(lambda: encode_chat(model.tokenizer, messages, options), "messages"), body)
    max_tokens = body.max_new_tokens or max(1, model.max_context - len(prompt_ids))
    return GenerationInput(prompt_ids, sampling_params(body, max_tokens, "messages", model, plan), body.budget,
                           tools=plan, speculation=body.speculation_trace)


def with_tools(messages: list[dict], plan: ToolPlan | None, options: ChatTemplateOptions, model: ServedModel
               ) -> tuple[list[dict], ChatTemplateOptions]:
    """The messages and template options that offer ``plan``'s tools: to the template's ``tools``,
    and in a system message of ours when the template does not read them."""
    if plan is None or plan.mode == "none":
        return messages, options
    options = dataclasses.replace(options, tools=tuple(plan.template_tools()))
    if model.tokenizer is not None and not template_reads_tools(model.tokenizer, options):
        messages = [{"role": "system", "content": plan.system_preamble()}, *messages]
    return messages, options


def completion_input(body: CompletionRequest, model: ServedModel) -> GenerationInput:
    if isinstance(body.prompt, str):
        prompt_ids = _tokenize(lambda: encode_prompt(model.tokenizer, body.prompt, body.add_special_tokens), "prompt")
    else:
        prompt_ids = list(body.prompt)
        model.check_token_ids(prompt_ids, "prompt")
    prompt_ids = truncated(prompt_ids, body)
    echo = prompt_text(prompt_ids, body, model) if body.echo else ""
    return GenerationInput(prompt_ids, sampling_params(body, body.max_tokens, "prompt", model), body.budget, echo)


def tokenize_input(body: TokenizeRequest, model: ServedModel) -> list[int]:
    """``POST /tokenize``: the ids a completion (``prompt``) or a chat (``messages``) would send."""
    if body.prompt is not None:
        return _tokenize(lambda: encode_prompt(model.tokenizer, body.prompt, body.add_special_tokens), "prompt")
    options = ChatTemplateOptions(add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message)
    messages = [m.as_template_dict() for m in body.messages]
    return _tokenize(lambda: encode_chat(model.tokenizer, messages, options), "messages")


def detokenize_input(body: DetokenizeRequest, model: ServedModel) -> str:
    """``POST /detokenize``: the text of the ids (special tokens kept, as vLLM does)."""
    if model.tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
    model.check_token_ids(body.tokens, "tokens")
    return model.tokenizer.decode(body.tokens)


def truncated(prompt_ids: list[int], body: SamplingRequest) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens, when the request asks for it."""
    keep = body.truncate_prompt_tokens
    return prompt_ids[-keep:] if keep is not None else prompt_ids


def prompt_text(prompt_ids: list[int], body: CompletionRequest, model: ServedModel) -> str:
    """The text ``echo`` repeats: the prompt as sent, or the decoded ids (a truncated or token-id prompt)."""
    if isinstance(body.prompt, str) and body.truncate_prompt_tokens is None:
        return body.prompt
    if model.tokenizer is None:
        raise APIError(400, "echo: this model has no tokenizer to turn the prompt's ids into text", param="echo")
    return model.tokenizer.decode(prompt_ids, skip_special_tokens=True)


def sampling_params(body: SamplingRequest, max_tokens: int, prompt_field: str, model: ServedModel,
                    tools: ToolPlan | None = None) -> SamplingParams:
    """The request's sampling fields; ``tools``: its tool plan (a forced call constrains the output)."""
    if body.top_k > model.vocab_size:
        raise APIError(400, f"top_k: must be -1, 0 (off) or at most the vocabulary's {model.vocab_size} tokens, "
                            f"got {body.top_k}", param="top_k")
    stop_token_ids = tuple(body.stop_token_ids or ())
    model.check_token_ids(list(stop_token_ids), "stop_token_ids")
    structured = structured_output(tools, requested(body), model, "response_format", "response_format or guided fields")
    return sampling_from(prompt_field, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                         max_tokens=max_tokens, stop=body.stop_strings, stop_token_ids=stop_token_ids,
                         seed=body.seed, ignore_eos=body.ignore_eos, logprobs=body.logprobs_count,
                         min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                         frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                         structured=structured)


def structured_output(tools: ToolPlan | None, asked: StructuredOutput | None, model: ServedModel, field: str,
                      fields: str) -> StructuredOutput | None:
    """What a request's output must follow, compiled: a forced tool call's schema, or what the request
    asked for in ``field`` (its structured-output fields, named ``fields``); both at once is a 400."""
    forced = tools.structured if tools is not None else None
    if forced is not None and asked is not None:
        raise APIError(400, f"tool_choice: a forced tool call (required or a named function) cannot be combined "
                            f"with {fields}", param="tool_choice")
    return checked(forced, model, "tools") if forced is not None else checked(asked, model, field)


def checked(structured: StructuredOutput | None, model: ServedModel, field: str) -> StructuredOutput | None:
    """``structured``, compiled here (off the event loop and the engine thread), or a 400 naming ``field``."""
    if structured is None:
        return None
    if model.compile_structured is None:
        raise APIError(400, f"{field}: structured output is not served for this model", param=field)
    try:
        model.compile_structured(structured)
    except RequestError as err:
        raise APIError(400, f"{field}: {err}", param=field) from None
    return structured


def sampling_from(prompt_field: str, **settings) -> SamplingParams:
    """``SamplingParams(**settings)``, a refusal answered with a 400 naming the field."""
    try:
        return SamplingParams(**settings)
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
