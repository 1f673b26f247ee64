"""Engine output -> OpenAI responses: whole bodies, and SSE streams ending with ``data: [DONE]``.

A stream sends a chunk per step that added text, then a chunk with the finish reason, then
(``stream_options.include_usage``) a chunk with no choices and the usage; a request that asked for
log-probabilities gets a chunk per step that added tokens, with theirs. An engine failure
after the headers went out is sent as an ``{"error": ...}`` event. Leaving the stream early
(client gone, cancelled) cancels the request so its slot is freed.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import AsyncIterator, Callable

from pydantic import BaseModel

from flashtree.server.async_engine import EngineFailure, GenerationDelta, RequestStream, RequestUsage
from flashtree.server.errors import APIError
from flashtree.server.logprobs import chat_logprobs, completion_logprobs
from flashtree.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage_of(usage: RequestUsage) -> Usage:
    return Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
                 total_tokens=usage.prompt_tokens + usage.completion_tokens, rounds=usage.rounds,
                 mean_acceptance_length=round(usage.mean_acceptance_length, 4))


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def last_delta(stream: RequestStream) -> GenerationDelta:
    """Wait for the request to finish; raises EngineFailure when the engine failed it. The last
    delta carries every token's log-probabilities (when the request asked)."""
    final, logprobs = None, []
    async for delta in stream:
        final = delta
        logprobs.extend(delta.logprobs or ())
    return final if final.logprobs is None else dataclasses.replace(final, logprobs=tuple(logprobs))


def chat_response(response_id: str, model: str, final: GenerationDelta, echo: str = "") -> ChatCompletionResponse:
    logprobs = None if final.logprobs is None else chat_logprobs(final.logprobs)
    choice = ChatChoice(message=AssistantMessage(content=final.full_text or ""), finish_reason=final.finish_reason,
                        logprobs=logprobs)
    return ChatCompletionResponse(id=response_id, model=model, choices=[choice], usage=usage_of(final.usage))


def completion_response(response_id: str, model: str, final: GenerationDelta, echo: str = "") -> CompletionResponse:
    """The whole answer (``echo``: the text it starts with, the prompt when the request asked)."""
    logprobs = None if final.logprobs is None else completion_logprobs(final.logprobs, len(echo))
    choice = CompletionChoice(text=echo + (final.full_text or ""), finish_reason=final.finish_reason,
                              logprobs=logprobs)
    return CompletionResponse(id=response_id, model=model, choices=[choice], usage=usage_of(final.usage))


class TextEvents:
    """The SSE event of a text chunk, rendered from a template: ``chunk`` (a pydantic chunk whose
    text is :data:`TEXT_SLOT`) is serialized once per stream, and each text is JSON-escaped into
    the slot. Building and serializing a pydantic model per streamed token cost tens of
    microseconds of the event loop's time, which the engine thread shares (the interpreter lock).
    The event is the same JSON as ``sse(chunk with that text)``; ``created`` is the stream's."""

    TEXT_SLOT = "\u0000flashtree-text\u0000"

    def __init__(self, chunk: BaseModel):
        rendered = sse(chunk)
        slot = json.dumps(self.TEXT_SLOT)
        if rendered.count(slot) != 1:
            raise ValueError(f"the chunk must hold the text slot once: {rendered!r}")
        self.head, self.tail = rendered.split(slot)

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


async def chat_events(stream: RequestStream, response_id: str, model: str, include_usage: bool,
                      cancel: Callable[[RequestStream], None], echo: str = "", logprobs: bool = False
                      ) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return sse(chat_chunk(delta, finish_reason))

    def chat_chunk(delta: dict, finish_reason: str | None = None, step: GenerationDelta | None = None
                   ) -> ChatCompletionChunk:
        values = None if step is None or step.logprobs is None else chat_logprobs(step.logprobs)
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=values)
        return ChatCompletionChunk(id=response_id, model=model, created=created, choices=[choice])

    def step_event(step: GenerationDelta) -> str | None:
        if logprobs:
            return sse(chat_chunk({"content": step.text}, step=step)) if step.token_ids or step.text else None
        return text_event(step.text) if step.text else None

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(ChatCompletionChunk(id=response_id, model=model, created=created, choices=[],
                                       usage=usage_of(usage)))

    text_event = TextEvents(chat_chunk({"content": TextEvents.TEXT_SLOT}))
    yield chunk({"role": "assistant", "content": ""})
    async for event in _guarded(stream, cancel, step_event, lambda d: chunk({}, d.finish_reason),
                                usage_chunk if include_usage else None):
        yield event


async def completion_events(stream: RequestStream, response_id: str, model: str, include_usage: bool,
                            cancel: Callable[[RequestStream], None], echo: str = "", logprobs: bool = False
                            ) -> AsyncIterator[str]:
    created = int(time.time())
    offset = len(echo)  # where the next token's text starts in the choice's text (log-probabilities)

    def completion_chunk(text: str, finish_reason: str | None = None, step: GenerationDelta | None = None
                         ) -> CompletionResponse:
        values = None
        if step is not None and step.logprobs is not None:
            values = completion_logprobs(step.logprobs, offset)
        choice = CompletionChoice(text=text, finish_reason=finish_reason, logprobs=values)
        return CompletionResponse(id=response_id, model=model, created=created, choices=[choice])

    def step_event(step: GenerationDelta) -> str | None:
        nonlocal offset
        if not logprobs:
            return text_event(step.text) if step.text else None
        if not step.token_ids and not step.text:
            return None
        event = sse(completion_chunk(step.text, step=step))
        offset += sum(len(entry.token) for entry in step.logprobs or ())
        return event

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(CompletionResponse(id=response_id, model=model, created=created, choices=[],
                                      usage=usage_of(usage)))

    text_event = TextEvents(completion_chunk(TextEvents.TEXT_SLOT))
    if echo:
        yield text_event(echo)
    async for event in _guarded(stream, cancel, step_event, lambda d: sse(completion_chunk("", d.finish_reason)),
                                usage_chunk if include_usage else None):
        yield event


async def _guarded(stream: RequestStream, cancel: Callable[[RequestStream], None],
                   step_event: Callable[[GenerationDelta], str | None], finish_chunk: Callable[[GenerationDelta], str],
                   usage_chunk: Callable[[RequestUsage], str] | None) -> AsyncIterator[str]:
    """The SSE events of one stream; cancels the request if the consumer leaves early. Deltas that
    queued up while the stream was behind go out in one write (one event each still)."""
    try:
        async for batch in stream.batches():
            events = [event for event in map(step_event, batch) if event is not None]
            last = batch[-1]
            if last.finished:
                events.append(finish_chunk(last))
                if usage_chunk is not None:
                    events.append(usage_chunk(last.usage))
            if events:
                yield "".join(events)
        yield SSE_DONE
    except EngineFailure as err:
        yield sse(APIError(500, str(err)).body())
        yield SSE_DONE
    finally:
        cancel(stream)
