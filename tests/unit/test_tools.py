"""Reading tool calls from answers (server/tools.py): forced calls from their constrained JSON, auto
calls from <tool_call> blocks (malformed or unknown ones leave the text as it is), the structured
output a forced call needs, and the streamed content held back from a call."""

from __future__ import annotations

import json

import pytest

from flashtree.server.errors import APIError
from flashtree.server.tools import AutoCallText, tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}


def test_named_call_reads_the_answer_as_its_arguments():
    plan = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(plan.structured.value) == WEATHER["function"]["parameters"]
    content, calls = plan.read('{"city": "Oslo"}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert calls[0].as_dict()["id"].startswith("call_") and calls[0].as_dict()["type"] == "function"


def test_required_calls_are_one_of_the_tools_each():
    plan = tool_plan([WEATHER, TIME], "required", False)
    schema = json.loads(plan.structured.value)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters given
    _, calls = plan.read('[{"name": "get_time", "arguments": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})]
    assert "maxItems" not in json.loads(tool_plan([WEATHER], "required", None).structured.value)


def test_auto_reads_tool_call_blocks_and_keeps_the_rest_as_content():
    plan = tool_plan([WEATHER], "auto", None)
    assert plan.structured is None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = plan.read(text)
    assert content == "Let me look." and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {
        "city": "Rome"}
    for text in ["no call here", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 "<tool_call>{not json}</tool_call>"]:
        assert plan.read(text) == (text, [])


@pytest.mark.parametrize("tools, choice, param", [
    ([], "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER, WEATHER], "auto", "tools"),
])
def test_bad_tool_settings_are_400s_that_name_the_field(tools, choice, param):
    with pytest.raises(APIError) as err:
        tool_plan(tools, choice, None)
    assert err.value.status == 400 and err.value.param == param


def test_streamed_content_is_held_back_from_a_call():
    held = AutoCallText()
    pieces = ["Sure", ", checking", " <tool", "_call>", '{"name": "x"}', "</tool_call>"]
    sent = "".join(held.feed(p) for p in pieces)
    assert sent == "Sure, checking " and held.calling
    plain = AutoCallText()
    assert plain.feed("a <to") == "a " and plain.feed("day") == "<today" and plain.rest() == ""
