"""Streamed SSE events without a server: text events rendered from a per-stream template are the
pydantic chunks' JSON byte for byte, and deltas that queued up behind a slow reader go out in
one write, in order, with an engine failure after the deltas before it."""

from __future__ import annotations

import asyncio
import json

import pytest

from flashtree.server.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse
from flashtree.server.responses import SSE_DONE, TextEvents, chat_events, completion_events, sse
from flashtree.server.stream import EngineFailure, GenerationDelta, RequestStream, RequestUsage

TEXTS = ("hello", 'quote " backslash \\ newline \n tab \t', "é 漢字 😀", "\x00\x1f\x7f", "\u2028\u2029",
         "</script>", "", " ")
USAGE = RequestUsage(prompt_tokens=3, completion_tokens=4, rounds=2, mean_acceptance_length=2.0)


def chat_chunk(text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", model='m "x"', created=7,
                               choices=[ChatChunkChoice(delta={"content": text})])


def completion_chunk(text: str) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", model="m", created=7, choices=[CompletionChoice(text=text)])


@pytest.mark.parametrize("make", [chat_chunk, completion_chunk])
def test_text_events_are_the_pydantic_chunks_json(make):
    event = TextEvents(make(TextEvents.TEXT_SLOT))
    for text in TEXTS:
        assert event(text) == sse(make(text))


def test_a_chunk_without_the_text_slot_is_refused():
    with pytest.raises(ValueError, match="text slot"):
        TextEvents(chat_chunk("no slot here"))


def text_delta(text: str) -> GenerationDelta:
    return GenerationDelta(token_ids=(1,), text=text, usage=None)


def last_delta(text: str = "") -> GenerationDelta:
    return GenerationDelta(token_ids=(2,), text=text, usage=USAGE, finish_reason="length", full_text="unused")


def queued_stream(loop: asyncio.AbstractEventLoop, deltas: list[GenerationDelta]) -> RequestStream:
    stream = RequestStream(loop)
    for delta in deltas:
        stream.deltas.put_nowait(delta)
    return stream


def collect(events) -> list:
    async def run():
        return [event async for event in events]
    return run()


def test_batches_take_every_queued_delta_up_to_the_last_one():
    async def run():
        stream = queued_stream(asyncio.get_running_loop(), [text_delta("a"), text_delta("b"), last_delta("c")])
        batches = [batch async for batch in stream.batches()]
        assert [[d.text for d in batch] for batch in batches] == [["a", "b", "c"]] and stream.finished
    asyncio.run(run())


def test_an_engine_failure_comes_after_the_deltas_queued_before_it():
    async def run():
        failed = GenerationDelta(token_ids=(), text="", usage=USAGE, error="boom")
        stream = queued_stream(asyncio.get_running_loop(), [text_delta("a"), failed, text_delta("never")])
        seen = []
        with pytest.raises(EngineFailure, match="boom"):
            async for batch in stream.batches():
                seen += [d.text for d in batch]
        assert seen == ["a"] and stream.finished
    asyncio.run(run())


def split_events(body: str) -> list[str]:
    return [event + "\n\n" for event in body.split("\n\n") if event]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_backlog_goes_out_in_one_write_with_the_same_events(kind):
    """Three text deltas and the last one queued before the stream is read: one write holds their
    events, the finish chunk and the usage chunk, the same events (ids, texts, order) as one write
    each would have sent."""
    texts = ["one", " two", ' "three"']

    async def run():
        stream = queued_stream(asyncio.get_running_loop(), [text_delta(t) for t in texts] + [last_delta()])
        events = chat_events if kind == "chat" else completion_events
        return await collect(events([stream], "id-1", "m", include_usage=True, cancel=lambda s: None))

    writes = asyncio.run(run())
    if kind == "chat":
        role, writes = writes[0], writes[1:]
        assert json.loads(role[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(writes) == 2 and writes[1] == SSE_DONE
    chunks = [json.loads(event[6:]) for event in split_events(writes[0])]
    assert len(chunks) == len(texts) + 2
    if kind == "chat":
        assert [c["choices"][0]["delta"].get("content") for c in chunks[:3]] == texts
        assert chunks[3]["choices"][0]["finish_reason"] == "length" and chunks[3]["choices"][0]["delta"] == {}
    else:
        assert [c["choices"][0]["text"] for c in chunks[:3]] == texts
        assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 4
    assert {c["id"] for c in chunks} == {"id-1"} and len({c["created"] for c in chunks}) == 1
