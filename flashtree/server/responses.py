"""Engine output -> OpenAI responses: whole bodies, and SSE streams ending with ``data: [DONE]``.

A stream sends a chunk per step that added text, then a chunk with the finish reason, then
(``stream_options.include_usage``) a chunk with no choices and the usage; a request that asked for
log-probabilities gets a chunk per step that added tokens, with theirs. An engine failure
after the headers went out is sent as an ``{"error": ...}`` event. Leaving the stream early
(client gone, cancelled) cancels the request so its slot is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator, Callable, NamedTuple

from pydantic import BaseModel

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
from flashtree.server.stream import EngineFailure, GenerationDelta, RequestStream, RequestUsage
from flashtree.server.tools import AutoCallText, ToolCall, ToolPlan, read_answer

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def combined_usage(usages: list[RequestUsage]) -> RequestUsage:
    """The usage of an n > 1 request: its prompt once (and the first choice's cached part of it), the
    choices' tokens and rounds together."""
    if len(usages) == 1:
        return usages[0]
    rounds = sum(u.rounds for u in usages)
    mean = sum(u.mean_acceptance_length * u.rounds for u in usages) / rounds if rounds else 0.0
    return RequestUsage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), rounds, mean,
                        usages[0].cached_tokens)


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


def chat_response(response_id: str, model: str, finals: list[GenerationDelta], echo: str = "",
                  tools: ToolPlan | None = None) -> ChatCompletionResponse:
    """The whole answer: a choice per request (``finals``: each one's last delta; ``tools``: how
    tool calls are read from it)."""
    choices = []
    for index, final in enumerate(finals):
        content, calls = read_answer(tools, final.full_text or "")
        message = AssistantMessage(content=content, tool_calls=[c.as_dict() for c in calls] or None)
        choices.append(ChatChoice(index=index, message=message, finish_reason=_finish_reason(final, calls),
                                  logprobs=None if final.logprobs is None else chat_logprobs(final.logprobs)))
    usage = combined_usage([final.usage for final in finals])
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=usage_of(usage))


def _finish_reason(final: GenerationDelta, calls: list[ToolCall]) -> str | None:
    """``tool_calls`` for an answer that ended on its own with calls."""
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason


def completion_response(response_id: str, model: str, finals: list[GenerationDelta], echo: str = "",
                        tools: ToolPlan | None = None) -> CompletionResponse:
    """The whole answer, a choice per request (``echo``: the text each starts with, the prompt when
    the request asked)."""
    choices = [CompletionChoice(index=index, text=echo + (final.full_text or ""), finish_reason=final.finish_reason,
                                logprobs=None if final.logprobs is None else completion_logprobs(final.logprobs,
                                                                                                 len(echo)))
               for index, final in enumerate(finals)]
    usage = combined_usage([final.usage for final in finals])
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=usage_of(usage))


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


class ChoiceEvents(NamedTuple):
    """How one choice's deltas become SSE events."""

    opening: list[str]  # sent before any delta (the role, the echoed prompt)
    step: Callable[[GenerationDelta], str | None]  # a delta's event (None: nothing to send)
    finish: Callable[[GenerationDelta], str]  # the finishing chunk, after the last delta's event


async def chat_events(streams: list[RequestStream], response_id: str, model: str, include_usage: bool,
                      cancel: Callable[[RequestStream], None], echo: str = "", logprobs: bool = False,
                      tools: ToolPlan | None = None) -> AsyncIterator[str]:
    created = int(time.time())

    def chat_chunk(index: int, delta: dict, finish_reason: str | None = None, step: GenerationDelta | None = None
                   ) -> ChatCompletionChunk:
        values = None if step is None or step.logprobs is None else chat_logprobs(step.logprobs)
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=values)
        return ChatCompletionChunk(id=response_id, model=model, created=created, choices=[choice])

    def choice_events(index: int) -> ChoiceEvents:
        text_event = TextEvents(chat_chunk(index, {"content": TextEvents.TEXT_SLOT}))

        def step_event(step: GenerationDelta) -> str | None:
            if step.speculation is not None and (step.speculation["rounds"] or step.text):
                chunk = chat_chunk(index, {"content": step.text}, step=step if logprobs else None)
                return sse({**chunk.model_dump(), "speculation": step.speculation})
            if logprobs:
                return sse(chat_chunk(index, {"content": step.text}, step=step)) if step.token_ids or step.text else None
            return text_event(step.text) if step.text else None

        opening = [sse(chat_chunk(index, {"role": "assistant", "content": ""}))]
        if tools is not None and tools.mode != "none":
            return tool_choice_events(index, opening)
        return ChoiceEvents(opening, step_event, lambda d: sse(chat_chunk(index, {}, d.finish_reason)))

    def tool_choice_events(index: int, opening: list[str]) -> ChoiceEvents:
        """A choice that may call tools: content goes out while it cannot be a call (forced calls:
        none); the calls, read from the whole answer, in one chunk at the end."""
        held = AutoCallText()

        def step_event(step: GenerationDelta) -> str | None:
            if tools.mode != "auto" or not step.text:
                return None
            text = held.feed(step.text)
            return sse(chat_chunk(index, {"content": text})) if text else None

        def finish(final: GenerationDelta) -> str:
            _, calls = tools.read(final.full_text or "")  # (auto: the content before the call went out already)
            if not calls:
                rest = held.rest() if tools.mode == "auto" else (final.full_text or "")
                events = [sse(chat_chunk(index, {"content": rest}))] if rest else []
                return "".join(events + [sse(chat_chunk(index, {}, final.finish_reason))])
            deltas = [{"index": i, **call.as_dict()} for i, call in enumerate(calls)]
            return (sse(chat_chunk(index, {"tool_calls": deltas}))
                    + sse(chat_chunk(index, {}, _finish_reason(final, calls))))

        return ChoiceEvents(opening, step_event, finish)

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(ChatCompletionChunk(id=response_id, model=model, created=created, choices=[],
                                       usage=usage_of(usage)))

    async for event in _guarded(streams, cancel, [choice_events(i) for i in range(len(streams))],
                                usage_chunk if include_usage else None):
        yield event


async def completion_events(streams: list[RequestStream], response_id: str, model: str, include_usage: bool,
                            cancel: Callable[[RequestStream], None], echo: str = "", logprobs: bool = False,
                            tools: ToolPlan | None = None) -> AsyncIterator[str]:
    created = int(time.time())

    def completion_chunk(index: int, text: str, finish_reason: str | None = None, values=None) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=values)
        return CompletionResponse(id=response_id, model=model, created=created, choices=[choice])

    def choice_events(index: int) -> ChoiceEvents:
        text_event = TextEvents(completion_chunk(index, TextEvents.TEXT_SLOT))
        offset = len(echo)  # where the next token's text starts in the choice's text (log-probabilities)

        def step_event(step: GenerationDelta) -> str | None:
            nonlocal offset
            if not logprobs:
                return text_event(step.text) if step.text else None
            if not step.token_ids and not step.text:
                return None
            values = None if step.logprobs is None else completion_logprobs(step.logprobs, offset)
            offset += sum(len(entry.token) for entry in step.logprobs or ())
            return sse(completion_chunk(index, step.text, values=values))

        return ChoiceEvents([text_event(echo)] if echo else [], step_event,
                            lambda d: sse(completion_chunk(index, "", d.finish_reason)))

    def usage_chunk(usage: RequestUsage) -> str:
        return sse(CompletionResponse(id=response_id, model=model, created=created, choices=[],
                                      usage=usage_of(usage)))

    async for event in _guarded(streams, cancel, [choice_events(i) for i in range(len(streams))],
                                usage_chunk if include_usage else None):
        yield event


async def _guarded(streams: list[RequestStream], cancel: Callable[[RequestStream], None],
                   choices: list[ChoiceEvents], usage_chunk: Callable[[RequestUsage], str] | None
                   ) -> AsyncIterator[str]:
    """The SSE events of the streams (one per choice), as their deltas come; the usage of them all
    after the last; cancels every request if the consumer leaves early. Deltas that queued up while a
    stream was behind go out in one write (one event each still)."""
    usages: list[RequestUsage | None] = [None] * len(streams)
    try:
        opening = "".join(event for choice in choices for event in choice.opening)
        if opening:
            yield opening
        async for index, batch in _merged(streams):
            choice = choices[index]
            events = [event for event in map(choice.step, batch) if event is not None]
            last = batch[-1]
            if last.finished:
                events.append(choice.finish(last))
                usages[index] = last.usage
                if usage_chunk is not None and all(u is not None for u in usages):
                    events.append(usage_chunk(combined_usage(usages)))
            if events:
                yield "".join(events)
        yield SSE_DONE
    except EngineFailure as err:
        yield sse(APIError(err.status, str(err), code=err.code).body())
        yield SSE_DONE
    finally:
        for stream in streams:
            cancel(stream)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, list[GenerationDelta]]]:
    """(stream index, batch of deltas) from every stream as they come (one stream: no tasks)."""
    if len(streams) == 1:
        async for batch in streams[0].batches():
            yield 0, batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for batch in stream.batches():
                await queue.put((index, batch, None))
        except EngineFailure as err:
            await queue.put((index, None, err))
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, batch, error = await queue.get()
            if error is not None:
                raise error
            if batch is None:
                running -= 1
                continue
            yield index, batch
    finally:
        for task in tasks:
            task.cancel()
