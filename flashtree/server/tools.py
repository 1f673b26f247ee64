"""Tool calls for chat completions: the tools go to the chat template, ``tool_choice`` decides how the
answer is read, and structured output makes a forced call well formed.

- ``none`` (or no tools): a text answer.
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is that
  function's arguments, constrained to its ``parameters`` schema; one call.
- ``required``: the answer is a JSON array of calls ``[{"name", "arguments"}]`` (one at most without
  ``parallel_tool_calls``), each constrained to its function's name and parameters.
- ``auto``: free text, in which ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (the Hermes format of Qwen2.5, Qwen3, SmolLM3 and others) are calls; the text around them is
  the content. A template that does not read ``tools`` gets the tools and that format in a system
  message of our own.

A call's id is ``call_`` and 24 hex digits; its arguments are JSON text, as OpenAI sends them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Literal

from flashtree.server.errors import APIError
from flashtree.structured import StructuredOutput

Mode = Literal["none", "auto", "named", "required"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its prompt and are read back from its answer."""

    mode: Mode
    functions: tuple[dict[str, Any], ...]  # each {"name", "description", "parameters"}
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def structured(self) -> StructuredOutput | None:
        """The structured output a forced call needs (None: free text)."""
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(self._parameters(self.named)))
        if self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": f["name"]}, "arguments": self._parameters(f["name"])}}
                     for f in self.functions]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutput("json", json.dumps(array))
        return None

    def _parameters(self, name: str) -> dict[str, Any]:
        function = next(f for f in self.functions if f["name"] == name)
        return function.get("parameters") or {"type": "object"}

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (transformers' ``tools`` argument)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def system_preamble(self) -> str:
        """What a template that ignores ``tools`` gets instead, as a system message."""
        listed = "\n".join(json.dumps(f) for f in self.functions)
        return (f"You may call the tools below. To call one, write {CALL_OPEN}{{\"name\": <the tool's name>, "
                f"\"arguments\": <a JSON object of its arguments>}}{CALL_CLOSE}.\nTools:\n{listed}")

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and calls."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # (cut short by max_tokens)
                return text, []
            return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls]
        if self.mode == "auto":
            return self._read_blocks(text)
        return text, []

    def _read_blocks(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        names = {f["name"] for f in self.functions}
        for block in _CALL_BLOCK.findall(text):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                return text, []  # a malformed block: the whole answer stays text
            if not isinstance(call, dict) or call.get("name") not in names:
                return text, []
            arguments = call.get("arguments", {})
            calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        if not calls:
            return text, []
        content = _CALL_BLOCK.sub("", text).strip()
        return content or None, calls


def read_answer(tools: ToolPlan | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's content and tool calls (all content without tools)."""
    return (text, []) if tools is None else tools.read(text)


def tool_plan(tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The plan of a request's ``tools`` / ``tool_choice`` (validated models' dumps); None: no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice: {tool_choice!r} needs tools; this request has none", param="tool_choice")
        return None
    functions = tuple({k: v for k, v in tool["function"].items() if v is not None} for tool in tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice: no tool is named {name!r}; the tools are {', '.join(names)}",
                           param="tool_choice")
        return ToolPlan("named", functions, name, parallel is not False)
    mode = tool_choice or "auto"
    return ToolPlan(mode, functions, None, parallel is not False)


class AutoCallText:
    """Streams an ``auto`` answer's content while holding back what may be a tool call: text up to a
    ``<tool_call>`` goes out (less a tail that may begin one); from the first call on, it waits for
    the end, when :meth:`ToolPlan.read` decides."""

    def __init__(self):
        self.text = ""
        self.sent = 0
        self.calling = False

    def feed(self, delta: str) -> str:
        """The part of the text so far that can go out now."""
        self.text += delta
        if self.calling:
            return ""
        at = self.text.find(CALL_OPEN)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = next((n for n in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1)
                     if CALL_OPEN.startswith(self.text[-n:])), 0)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def rest(self) -> str:
        """The text not sent yet (at the end, when no call was read)."""
        return self.text[self.sent:]
