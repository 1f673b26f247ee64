"""OpenAI's Responses API (``/v1/responses``) driven by the official ``openai`` client against a real
server: the same greedy text as chat completions for the same conversation; the stream helper's
final response equal to the whole one; previous_response_id continues a stored conversation; GET
and DELETE; the store's bound; bad input answered with OpenAI errors."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from tests.support.server import ServerThread, save_tiny_chat_model, server_config

LIMITS = dict(max_running=4, max_context=160, prefill_chunk=8, max_waiting=64)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = save_tiny_chat_model(tmp_path_factory.mktemp("responses") / "target")
    config = dataclasses.replace(server_config(target, **LIMITS), responses_store_size=3)
    with ServerThread(config) as running:
        yield running


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_text(server, messages, max_tokens: int) -> str:
    out = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, **GREEDY)
    return out.choices[0].message.content


def test_a_response_is_the_chat_completion_of_the_same_conversation(served):
    got = client(served).responses.create(model="tiny", instructions="you are a cat .", input="hello world",
                                          max_output_tokens=10, **GREEDY)
    expected = chat_text(served, [{"role": "system", "content": "you are a cat ."},
                                  {"role": "user", "content": "hello world"}], 10)
    assert got.id.startswith("resp_") and got.object == "response" and got.output_text == expected
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 10 and got.usage.total_tokens == got.usage.input_tokens + 10


def test_the_stream_helper_builds_the_same_response(served):
    api = client(served)
    whole = api.responses.create(model="tiny", input=[{"role": "user", "content": "sing a song"}],
                                 max_output_tokens=8, **GREEDY)
    with api.responses.stream(model="tiny", input=[{"role": "user", "content": "sing a song"}], max_output_tokens=8,
                              **GREEDY) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    final = events[-1].response  # (incomplete: cut at max_output_tokens, as OpenAI ends such a stream)
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.incomplete"
    raw = httpx.post(f"{served.url}/v1/responses", json={"model": "tiny", "input": "sing a song", "max_output_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True, "stream": True},
                     timeout=60).text
    deltas_text = "".join(line for line in _deltas(raw))
    assert deltas_text == whole.output_text


def _deltas(sse: str):
    import json

    for line in sse.splitlines():
        if line.startswith("data: "):
            body = json.loads(line[6:])
            if body["type"] == "response.output_text.delta":
                yield body["delta"]


def test_previous_response_id_continues_the_stored_conversation(served):
    api = client(served)
    first = api.responses.create(model="tiny", input="hello", max_output_tokens=4, **GREEDY)
    second = api.responses.create(model="tiny", input="and the cat ?", previous_response_id=first.id,
                                  max_output_tokens=6, **GREEDY)
    expected = chat_text(served, [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "and the cat ?"}], 6)
    assert second.output_text == expected and second.previous_response_id == first.id
    assert api.responses.retrieve(second.id).output_text == second.output_text
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        api.responses.retrieve(second.id)


def test_the_store_keeps_the_most_recent_and_forgets_the_rest(served):
    api = client(served)
    ids = [api.responses.create(model="tiny", input=f"n {i}", max_output_tokens=2, **GREEDY).id for i in range(4)]
    with pytest.raises(openai.NotFoundError, match="evicted"):
        api.responses.create(model="tiny", input="more", previous_response_id=ids[0], max_output_tokens=2)
    assert api.responses.retrieve(ids[-1]).id == ids[-1]
    unstored = api.responses.create(model="tiny", input="x", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": []}, "input"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
     "text.format"),
    ({"model": "tiny", "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "tiny", "input": [{"role": "robot", "content": "x"}]}, "input"),
])
def test_bad_requests_get_openai_errors(served, body, param):
    response = httpx.post(f"{served.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_completed_stream_gives_the_final_response(served):
    """A response that ends on its own (end of turn) ends its stream with response.completed."""
    api = client(served)
    common = dict(model="tiny", input="hello", max_output_tokens=120, temperature=0)
    whole = api.responses.create(**common)
    assert whole.status == "completed"
    with api.responses.stream(**common) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.id != whole.id
