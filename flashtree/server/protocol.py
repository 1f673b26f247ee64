"""Request and response bodies of the OpenAI chat and completions APIs (the subset we serve).

Requests ignore unknown fields (clients send many), validate the ones we read strictly
(``"5"`` is not an integer), and reject the ones we cannot honour (``n != 1``, logprobs,
tools, penalties) with the field's name, so a client learns what is wrong.

Defaults follow OpenAI: temperature 1, top_p 1, max_tokens 16 for completions and the rest
of the context for chat; a max_tokens that runs past the context ends there ("length").
Extensions beyond OpenAI: ``top_k``, ``ignore_eos`` and ``budget`` (lowers the request's
DDTree budget; 0 = no drafted tokens). ``usage`` carries ``rounds`` and
``mean_acceptance_length`` besides the token counts.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

NonNegativeFloat = Annotated[float, Field(strict=True, ge=0)]
UnitInterval = Annotated[float, Field(strict=True, gt=0, le=1)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Request):
    include_usage: StrictBool = False


class SamplingRequest(_Request):
    """Fields shared by chat and completions requests."""

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: NonNegativeFloat = 1.0
    top_p: UnitInterval = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # 0 or -1: off
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool = False
    budget: Annotated[StrictInt, Field(ge=0)] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only n=1 is supported, got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError("penalties are not supported; leave it unset or 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The message as a chat template reads it (text parts joined)."""
        if self.content is None:
            return {"role": self.role, "content": ""}
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": "".join(part.text for part in self.content)}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = None
    tools: list[Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls are not supported")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
    max_tokens: PositiveInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value


# ---------------------------------------------------------------------------- responses
class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


def _now() -> int:
    return int(time.time())


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    rounds: int  # target verification rounds (spec decoding); tokens per round = acceptance length
    mean_acceptance_length: float


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(_Response):
    index: int = 0
    delta: dict[str, str]  # {"role", "content"} on the first chunk, {"content"} after, {} at the end
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
