"""Request and response bodies of the OpenAI chat and completions APIs (the subset we serve).

Requests ignore fields nobody serves (clients send many), validate the ones we read strictly
(``"5"`` is not an integer), and answer every field vLLM serves that we do not honour yet with a
400 that names it (:data:`NOT_HONOURED`), unless it holds its "off" value: nothing a client asks
for is silently dropped.

Log-probabilities (``logprobs`` and ``top_logprobs`` for chat, ``logprobs`` for completions; at most
20 alternatives) are the target's raw ones (``server/logprobs.py``).

Defaults follow OpenAI: temperature 1 (in [0, 2]), top_p 1, max_tokens 16 for completions and the
rest of the context for chat; a max_tokens that runs past the context ends there ("length").
Extensions beyond OpenAI, as vLLM names them: ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``truncate_prompt_tokens``; for chat ``add_generation_prompt``, ``continue_final_message``,
``chat_template`` and ``chat_template_kwargs``; for completions ``add_special_tokens``. Ours:
``budget`` (lowers the request's DDTree budget; 0 = no drafted tokens) and, for streamed chat,
``speculation_trace`` (each chunk carries ``speculation``: its rounds' acceptance lengths and the
newest draft tree, as the playground at ``/`` draws them; trees need ``--recent-trees``, on in serve). ``usage`` carries
``rounds`` and ``mean_acceptance_length`` besides the token counts.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from flashtree.sampling import MAX_LOGPROBS

Temperature = Annotated[float, Field(strict=True, ge=0, le=2, allow_inf_nan=False)]
UnitInterval = Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]
LogprobCount = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2, allow_inf_nan=False)]
MAX_CHOICES = 16  # n at most

# field -> (the values that mean "off" and are accepted, why any other value is refused)
NOT_HONOURED_COMMON: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "only best_of = 1 is served"),
    "logit_bias": ((None, {}), "logit_bias is not served"),
    "min_p": ((None, 0), "min_p is not served; use top_p or top_k"),
    "use_beam_search": ((None, False), "beam search is not served"),
    "length_penalty": ((None, 1), "length_penalty (beam search) is not served"),
    "include_stop_str_in_output": ((None, False), "stop strings are always cut from the output"),
    "skip_special_tokens": ((None, True), "the output text always skips special tokens"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always skipped"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not served yet; logprobs (of the output) is"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not served"),
    "bad_words": ((None, []), "bad_words is not served"),
    "logits_processors": ((None, []), "logits processors are not served"),
    "return_tokens_as_token_ids": ((None, False), "tokens are returned as text"),
    "priority": ((None, 0), "requests have no priorities here"),
    "structural_tag": ((None,), "structured output by structural tags is not served; use response_format, "
                                "guided_json, guided_regex, guided_choice or guided_grammar"),
    "guided_decoding_backend": ((None,), "the grammar backend is the server's (--grammar-backend)"),
    "guided_whitespace_pattern": ((None,), "JSON comes out compact; a whitespace pattern is not served"),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    not_honoured: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_honoured(cls, data: Any) -> Any:
        """A field of :data:`NOT_HONOURED` set to anything but its "off" value is refused, named."""
        if isinstance(data, dict):
            for name, (off, why) in cls.not_honoured.items():
                if name in data and not any(_same(data[name], value) for value in off):
                    raise ValueError(f"{name}: {why} (got {data[name]!r})")
        return data


def _same(value: Any, off: Any) -> bool:
    """``value`` is the "off" value ``off`` (``0`` is ``0.0``, but ``False`` is not ``0``)."""
    return isinstance(value, bool) == isinstance(off, bool) and value == off


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    name: StrictStr = "response"
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # (always enforced: the grammar allows nothing else)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class TextFormat(_Request):
    """The Responses API's ``text.format``: the json_schema fields sit beside ``type``."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr = "response"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` object (server/structured_fields.py reads these)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class StreamOptions(_Request):
    include_usage: StrictBool = False


class SamplingRequest(_Request):
    """Fields shared by chat and completions requests."""

    not_honoured = NOT_HONOURED_COMMON
    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: UnitInterval = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # 0 or -1: off
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    truncate_prompt_tokens: PositiveInt | None = None  # keep only the prompt's last N tokens
    user: StrictStr | None = None  # the caller's end-user id (recorded nowhere)
    budget: Annotated[StrictInt, Field(ge=0)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1  # choices: one request per choice, the prompt shared
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0  # output tokens before a stop token or string may end it
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(strict=True, gt=0, le=2, allow_inf_nan=False)] = 1.0
    # structured output (at most one; server/structured_fields.py)
    response_format: ResponseFormat | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per emitted token's log-probability (None: no log-probabilities)."""
        return None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr  # JSON text


class MessageToolCall(_Request):
    """A call an assistant message made (sent back in the conversation)."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers
    name: StrictStr | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (text parts joined; a call's arguments as an
        object when they are JSON, as transformers' templates expect)."""
        if self.content is None:
            message: dict[str, Any] = {"role": self.role, "content": ""}
        elif isinstance(self.content, str):
            message = {"role": self.role, "content": self.content}
        else:
            message = {"role": self.role, "content": "".join(part.text for part in self.content)}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Request):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None  # a JSON schema of the arguments (object)
    strict: StrictBool | None = None  # (a forced call always follows the schema)


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    not_honoured = {
        **NOT_HONOURED_COMMON,
        "functions": ((None, []), "the legacy functions field is not served; use tools"),
        "function_call": ((None, "none"), "the legacy function_call field is not served; use tool_choice"),
        "echo": ((None, False), "echo is served for completions only"),
        "documents": ((None, []), "documents are not served"),
    }
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    logprobs: StrictBool | None = None  # each output token's log-probability
    top_logprobs: LogprobCount | None = None  # with logprobs: this many likeliest alternatives per token
    speculation_trace: StrictBool = False  # ours: stream chunks carry "speculation" (rounds, newest draft tree)
    tools: list[ToolDefinition] | None = None  # function tools (server/tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _final_message_options(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs: set logprobs to true to get alternatives (got top_logprobs "
                             f"{self.top_logprobs} with logprobs false)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt to false to continue the final "
                             "message (they cannot both be true)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError(f"continue_final_message: the final message must be the assistant's, "
                             f"got {self.messages[-1].role!r}")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict | None) -> dict | None:
        reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here; allowed: template variables other than "
                             f"{', '.join(sorted(RESERVED_TEMPLATE_KEYS))}")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# apply_chat_template's own arguments: a request names them as fields, not as template variables
RESERVED_TEMPLATE_KEYS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                    "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                    "truncation", "max_length", "return_tensors", "return_dict",
                                    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class CompletionRequest(SamplingRequest):
    not_honoured = {
        **NOT_HONOURED_COMMON,
        "suffix": ((None, ""), "suffix (insertion) is not served"),
    }
    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: PositiveInt | None = 16  # OpenAI's default for completions
    echo: StrictBool = False  # the answer starts with the prompt's text
    add_special_tokens: StrictBool = False  # a text prompt's tokens get the tokenizer's special tokens
    logprobs: LogprobCount | None = None  # each output token's log-probability and this many alternatives

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> "CompletionRequest":
        if self.echo and self.logprobs is not None:
            raise ValueError("logprobs: with echo it needs the prompt's log-probabilities, which are not served "
                             "yet; ask for logprobs without echo")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Request):
    """``POST /tokenize``: a text prompt, or a conversation through the chat template (vLLM's shape)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt (text) or messages (a conversation), not both or neither")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------- responses
class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(_Response):
    cached_tokens: int  # prompt tokens whose KV pages came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    rounds: int  # target verification rounds (spec decoding); tokens per round = acceptance length
    mean_acceptance_length: float


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(_Response):
    index: int = 0
    delta: dict[str, Any]  # {"role", "content"} on the first chunk, {"content"} after ({"tool_calls"}), {} at the end
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    """Both the whole response and a streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "flashtree"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
