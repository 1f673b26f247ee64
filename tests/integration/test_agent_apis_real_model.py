"""The three APIs on the embedded model (SmolLM2 with its shipped drafter, DDTree as `serve` runs it):
the same greedy text for the same conversation through chat completions, Responses and Messages;
structured output through the official client's parse helpers and vLLM's guided fields."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pydantic
import pytest

from tests.support.browser import chat_in_playground
from tests.support.server import ServerThread, server_config

CONVERSATION = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def served():
    from flashtree.speculative.defaults import default_spec

    method, draft = default_spec("smollm2", None, None)
    config = server_config("smollm2", method=method, draft=draft, max_running=4, max_context=512, recent_trees=4)
    with ServerThread(config) as running:
        yield running


def test_the_three_apis_give_the_same_greedy_text(served):
    assert served.method == "ddtree"
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)
    chat = api.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24, temperature=0)
    response = api.responses.create(model="tiny", input=CONVERSATION, max_output_tokens=24, temperature=0)
    message = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=120).messages.create(
        model="tiny", max_tokens=24, messages=CONVERSATION, extra_body={"temperature": 0})
    text = chat.choices[0].message.content
    assert text and response.output_text == text and message.content[0].text == text


# ---------------------------------------------------------------------------- structured output
class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str
    age: int
    city: str


PERSON_REQUEST = [{"role": "user", "content": "Invent a person and give their name, age and city as JSON."}]


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_the_openai_client_parses_a_json_schema_answer(served):
    """The official client's parse helpers send a strict json_schema format and validate the answer."""
    api = _client(served)
    chat = api.chat.completions.parse(model="tiny", messages=PERSON_REQUEST, response_format=Person, max_tokens=80,
                                      temperature=0)
    assert isinstance(chat.choices[0].message.parsed, Person) and chat.choices[0].finish_reason == "stop"
    sampled = api.chat.completions.parse(model="tiny", messages=PERSON_REQUEST, response_format=Person,
                                         max_tokens=80, temperature=1.0, seed=5, n=3)
    assert all(isinstance(c.message.parsed, Person) for c in sampled.choices)
    response = api.responses.parse(model="tiny", input=PERSON_REQUEST, text_format=Person, max_output_tokens=80,
                                   temperature=0)
    assert isinstance(response.output_parsed, Person)
    assert response.output_parsed == chat.choices[0].message.parsed  # one engine path, the same greedy tokens


def test_vllm_guided_fields_and_json_object(served):
    api = _client(served)
    regex = api.chat.completions.create(model="tiny", messages=PERSON_REQUEST, max_tokens=30, temperature=0,
                                        extra_body={"guided_regex": r"[A-Z][a-z]+ is [0-9]{2} years old\."})
    assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2} years old\.", regex.choices[0].message.content)
    choice = api.completions.create(model="tiny", prompt="The sky is", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["blue", "green", "red"]})
    assert choice.choices[0].text in ("blue", "green", "red")
    anything = api.chat.completions.create(model="tiny", messages=PERSON_REQUEST, max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_structured_output_is_a_400_that_names_it(served, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        _client(served).chat.completions.create(model="tiny", messages=PERSON_REQUEST, max_tokens=8, extra_body=body)
    assert field in str(err.value)


# ---------------------------------------------------------------------------- tool calls
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _weather_arguments(text: str) -> dict:
    arguments = json.loads(text)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


def test_a_named_tool_choice_gives_a_call_with_valid_arguments(served):
    api = _client(served)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = api.chat.completions.create(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                                        tool_choice=named, max_tokens=60, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = _weather_arguments(call.function.arguments)
    stream = api.chat.completions.create(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                                         tool_choice=named, max_tokens=60, temperature=0, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [tc.function.name for tc in streamed] == ["get_weather"]
    assert json.loads(streamed[0].function.arguments) == arguments  # the same greedy call
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not any(d.content for d in deltas)


def test_required_tool_choice_and_the_conversation_after_the_call(served):
    api = _client(served)
    first = api.chat.completions.create(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                        temperature=0)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    history = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = api.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL, TIME_TOOL],
                                         max_tokens=40, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_tool_choice_mistakes_are_400s(served):
    api = _client(served)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        api.chat.completions.create(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], max_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        api.chat.completions.create(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], max_tokens=8,
                                    tool_choice="required", response_format={"type": "json_object"})


def test_responses_api_function_calls_and_their_outputs(served):
    api = _client(served)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}, {"type": "function", **TIME_TOOL["function"]}]
    choice = {"type": "function", "name": "get_weather"}
    response = api.responses.create(model="tiny", input=WEATHER_QUESTION, tools=tools, tool_choice=choice,
                                    max_output_tokens=60, temperature=0)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = _weather_arguments(call.arguments)
    with api.responses.stream(model="tiny", input=WEATHER_QUESTION, tools=tools, tool_choice=choice,
                              max_output_tokens=60, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [json.loads(i.arguments) for i in streamed] == [arguments]
    follow_up = api.responses.create(model="tiny", previous_response_id=response.id, tools=tools,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature": 21}'}], max_output_tokens=30, temperature=0)
    assert follow_up.status in ("completed", "incomplete") and follow_up.output


def test_messages_api_tool_use_and_tool_results(served):
    api = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER_TOOL, TIME_TOOL)]
    forced = {"type": "tool", "name": "get_weather"}
    message = api.messages.create(model="tiny", max_tokens=60, messages=WEATHER_QUESTION, tools=tools,
                                  tool_choice=forced, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("celsius", "fahrenheit")
    with api.messages.stream(model="tiny", max_tokens=60, messages=WEATHER_QUESTION, tools=tools,
                             tool_choice=forced, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.input for b in streamed.content if b.type == "tool_use"] == [
        use.input]
    any_tool = api.messages.create(model="tiny", max_tokens=80, messages=WEATHER_QUESTION, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0})
    assert [b.name for b in any_tool.content if b.type == "tool_use"][0] in ("get_weather", "get_time")
    history = WEATHER_QUESTION + [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear"}]}]
    answer = api.messages.create(model="tiny", max_tokens=30, messages=history, tools=tools,
                                 extra_body={"temperature": 0})
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_the_playground_in_a_browser(served, tmp_path):
    """A real answer streams into the page beside its rounds and its last draft tree."""
    question = "Name three colors of the rainbow."
    expected = _client(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                       max_tokens=256, temperature=0)
    answer = chat_in_playground(served.url, question, tmp_path / "playground.png", "tiny")
    assert answer.text == expected.choices[0].message.content and len(answer.text) > 10
    # (the adaptive policy may split the same tokens into other rounds on another run)
    assert answer.rounds and sum(answer.rounds) >= expected.usage.completion_tokens - 1
    assert answer.tree_nodes >= 1 and not answer.page_errors  # (the adaptive default's last round may be plain:
    # a root-only tree; tests/integration/test_playground.py checks drafted nodes with a fixed DDTree)
