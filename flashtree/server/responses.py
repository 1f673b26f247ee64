"""Engine output -> OpenAI responses: whole bodies, and SSE streams ending with ``data: [DONE]``.

A stream sends a chunk per step that added text, then a chunk with the finish reason, then
(``stream_options.include_usage``) a chunk with no choices and the usage. An engine failure
after the headers went out is sent as an ``{"error": ...}`` event. Leaving the stream early
(client gone, cancelled) cancels the request so its slot is freed.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Callable

from pydantic import BaseModel

from flashtree.server.async_engine import EngineFailure, GenerationDelta, RequestStream, RequestUsage
from flashtree.server.errors import APIError
from flashtree.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionResponse, CompletionChoice, CompletionResponse, Usage)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage_of(usage: RequestUsage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 total_tokens=usage.prompt_tokens + usage.completion_tokens, rounds=usage.rounds,
                 mean_acceptance_length=round(usage.mean_acceptance_length, 4))


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def last_delta(stream: RequestStream) -> GenerationDelta:
    """Wait for the request to finish; raises EngineFailure when the engine failed it."""
    final = None
    async for delta in stream:
        final = delta
    return final


def chat_response(response_id: str, model: str, final: GenerationDelta) -> ChatCompletionResponse:
    choice = ChatChoice(message=AssistantMessage(content=final.full_text or ""), finish_reason=final.finish_reason)
    return ChatCompletionResponse(id=response_id, model=model, choices=[choice], usage=usage_of(final.usage))


def completion_response(response_id: str, model: str, final: GenerationDelta) -> CompletionResponse:
    choice = CompletionChoice(text=final.full_text or "", finish_reason=final.finish_reason)
    return CompletionResponse(id=response_id, model=model, choices=[choice], usage=usage_of(final.usage))


async def chat_events(stream: RequestStream, response_id: str, model: str, include_usage: bool,
                      cancel: Callable[[RequestStream], None]) -> AsyncIterator[str]:
    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(id=response_id, model=model, choices=[choice]))

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage_of(usage)))

    yield chunk({"role": "assistant", "content": ""})
    async for event in _guarded(stream, cancel, lambda d: chunk({"content": d.text}),
                                lambda d: chunk({}, d.finish_reason), usage_chunk if include_usage else None):
        yield event


async def completion_events(stream: RequestStream, response_id: str, model: str, include_usage: bool,
                            cancel: Callable[[RequestStream], None]) -> AsyncIterator[str]:
    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return sse(CompletionResponse(id=response_id, model=model, choices=[choice]))

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(CompletionResponse(id=response_id, model=model, choices=[], usage=usage_of(usage)))

    async for event in _guarded(stream, cancel, lambda d: chunk(d.text), lambda d: chunk("", d.finish_reason),
                                usage_chunk if include_usage else None):
        yield event


async def _guarded(stream: RequestStream, cancel: Callable[[RequestStream], None],
                   text_chunk: Callable[[GenerationDelta], str], finish_chunk: Callable[[GenerationDelta], str],
                   usage_chunk: Callable[[RequestUsage], str] | None) -> AsyncIterator[str]:
    """The SSE events of one stream; cancels the request if the consumer leaves early."""
    try:
        async for delta in stream:
            if delta.text:
                yield text_chunk(delta)
            if delta.finished:
                yield finish_chunk(delta)
                if usage_chunk is not None:
                    yield usage_chunk(delta.usage)
        yield SSE_DONE
    except EngineFailure as err:
        yield sse(APIError(500, str(err)).body())
        yield SSE_DONE
    finally:
        cancel(stream)
