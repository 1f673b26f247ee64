"""Anthropic's Messages API (``POST /v1/messages``), a thin adapter over the chat completions path.

The request's ``system`` and ``messages`` become the chat template's messages and its sampling
fields a :class:`~flashtree.sampling.SamplingParams`; the engine request, its stream and its end are
the chat path's. Answers use Anthropic's shapes: a ``message`` object with text content blocks,
``stop_reason`` (end_turn, max_tokens, stop_sequence), ``usage`` (input / output tokens), the
streamed event sequence (message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta, message_stop) and errors as ``{"type": "error", "error": ...}``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr

from flashtree.models.tokenizer import encode_chat
from flashtree.server.async_engine import EngineFailure, GenerationDelta, RequestStream
from flashtree.server.generation import (
    GenerationInput,
    ServedModel,
    _tokenize,
    sampling_from,
)
from flashtree.server.protocol import PositiveInt, _Request


class TextBlock(_Request):
    type: Literal["text"]
    text: StrictStr


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: StrictStr | list[TextBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class MessagesRequest(_Request):
    not_honoured = {
        "tools": ((None, []), "tool use is not served yet"),
        "tool_choice": ((None,), "tool use is not served yet"),
        "thinking": ((None, {"type": "disabled"}), "extended thinking is not served"),
    }
    model: StrictStr
    max_tokens: PositiveInt
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=0)] = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None  # (user_id: recorded nowhere)

    def chat_messages(self) -> list[dict[str, str]]:
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(
            block.text for block in self.system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": m.role, "content": m.text()} for m in self.messages]


def messages_input(body: MessagesRequest, model: ServedModel) -> GenerationInput:
    """The engine input of a Messages request (on the tokenizing thread)."""
    messages = body.chat_messages()
    prompt_ids = _tokenize(lambda: encode_chat(model.tokenizer, messages), "messages")
    params = sampling_from("messages", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           max_tokens=body.max_tokens, stop=tuple(body.stop_sequences or ()))
    return GenerationInput(prompt_ids, params, None)


def stop_reason(final: GenerationDelta, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    if final.finish_reason == "length":
        return "max_tokens", None
    hit = stops_hit(final, stops)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def stops_hit(final: GenerationDelta, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the request (its text is cut just before it), if one did."""
    return final.stopped_by if isinstance(final.stopped_by, str) and final.stopped_by in stops else None


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_response(response_id: str, model: str, final: GenerationDelta, stops: tuple[str, ...]) -> dict:
    reason, sequence = stop_reason(final, stops)
    return {"id": response_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": final.full_text or ""}], "stop_reason": reason,
            "stop_sequence": sequence, "usage": {"input_tokens": final.usage.prompt_tokens,
                                                 "output_tokens": final.usage.completion_tokens,
                                                 "cache_read_input_tokens": final.usage.cached_tokens}}


def event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def message_events(stream: RequestStream, response_id: str, model: str, prompt_tokens: int,
                         stops: tuple[str, ...], cancel: Callable[[RequestStream], None]) -> AsyncIterator[str]:
    """The Messages event sequence of one request; an engine failure ends it with an error event."""
    start = {"id": response_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield (event("message_start", {"message": start})
           + event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
           + event("ping", {}))
    try:
        async for batch in stream.batches():
            text = "".join(delta.text for delta in batch)
            out = [event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})] if text else []
            last = batch[-1]
            if last.finished:
                reason, sequence = stop_reason(last, stops)
                out += [event("content_block_stop", {"index": 0}),
                        event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": {"output_tokens": last.usage.completion_tokens}}),
                        event("message_stop", {})]
            if out:
                yield "".join(out)
    except EngineFailure as err:
        yield event("error", {"error": {"type": "api_error", "message": str(err)}})
    finally:
        cancel(stream)
