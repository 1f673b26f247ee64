"""Anthropic's Messages API (``/v1/messages``) driven by the official ``anthropic`` client against a real
server: the same greedy tokens as chat completions for the same conversation, with and without
speculation; the streamed event sequence; stop reasons; x-api-key; errors in Anthropic's shape."""

from __future__ import annotations

import dataclasses

import anthropic
import httpx
import openai
import pytest

from tests.support.server import ServerThread, save_tiny_chat_model, server_config

LIMITS = dict(max_running=4, max_context=128, prefill_chunk=8, max_waiting=64)
KEY = "sk-test-anthropic"
MESSAGES = [{"role": "user", "content": "hello world , how is the cat ?"}]
SYSTEM = "you are a cat ."
GREEDY = {"temperature": 0}  # (the client no longer takes sampling settings as arguments)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = save_tiny_chat_model(tmp_path_factory.mktemp("anthropic") / "target")
    config = server_config(target, api_key=KEY, **LIMITS)
    with ServerThread(config) as running:
        yield running


def messages_client(server: ServerThread, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def test_a_message_is_the_chat_completion_of_the_same_conversation(served):
    got = messages_client(served).messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                                  messages=MESSAGES)
    chat = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="tiny", max_tokens=12, extra_body=GREEDY, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert [block.type for block in got.content] == ["text"]
    assert got.content[0].text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens and got.usage.output_tokens == chat.usage.completion_tokens
    assert got.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")


def test_the_stream_is_the_messages_event_sequence_with_the_same_text(served):
    client = messages_client(served)
    whole = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, messages=MESSAGES)
    with client.messages.stream(model="tiny", max_tokens=10, extra_body=GREEDY, messages=MESSAGES) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-1] == "message_stop"
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"] and "text" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_named_as_the_stop_reason(served):
    client = messages_client(served)
    free = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=MESSAGES).content[0].text
    stop = free.split()[2]
    got = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=MESSAGES,
                                 stop_sequences=[stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    assert stop not in got.content[0].text and free.startswith(got.content[0].text)


def test_speculation_gives_the_same_message(tmp_path):
    from tests.dflash_helpers import save_tiny_drafter

    target = save_tiny_chat_model(tmp_path / "target")
    drafter = save_tiny_drafter(target, tmp_path / "drafter", block_size=4, layers=1)
    texts = []
    for method, draft in (("none", None), ("ddtree", str(drafter))):
        config = server_config(target, method=method, draft=draft, **LIMITS)
        with ServerThread(config) as server:
            got = messages_client(server).messages.create(model="tiny", max_tokens=16, extra_body=GREEDY,
                                                          messages=MESSAGES)
            texts.append(got.content[0].text)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("body,status,kind,words", [
    ({"model": "tiny", "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny", "max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error",
     "role"),
    ({"model": "tiny", "max_tokens": 5, "messages": MESSAGES, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "tiny", "max_tokens": 5, "messages": MESSAGES, "tools": [{"name": "f"}]}, 400, "invalid_request_error",
     "input_schema"),
    ({"model": "tiny", "max_tokens": 5, "messages": MESSAGES, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     400, "invalid_request_error", "tools"),
    ({"model": "tiny", "max_tokens": 5, "messages": MESSAGES, "tool_choice": {"type": "tool"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error", "tool_choice"),
    ({"model": "other", "max_tokens": 5, "messages": MESSAGES}, 404, "not_found_error", "other"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "cat " * 400}]}, 400,
     "invalid_request_error", "context"),
])
def test_bad_requests_get_anthropic_errors(served, body, status, kind, words):
    response = httpx.post(f"{served.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]


def test_the_key_is_checked_in_either_header(served):
    with pytest.raises(anthropic.AuthenticationError):
        messages_client(served, key="wrong").messages.create(model="tiny", max_tokens=2, messages=MESSAGES)
    response = httpx.post(f"{served.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": MESSAGES},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200 and response.json()["type"] == "message"
