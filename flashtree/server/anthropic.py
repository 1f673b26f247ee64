"""Anthropic's Messages API (``POST /v1/messages``), a thin adapter over the chat completions path.

The request's ``system`` and ``messages`` become the chat template's messages and its sampling
fields a :class:`~flashtree.sampling.SamplingParams`; the engine request, its stream and its end are
the chat path's. Answers use Anthropic's shapes: a ``message`` object with text content blocks,
``stop_reason`` (end_turn, max_tokens, stop_sequence, tool_use), ``usage`` (input / output tokens), the
streamed event sequence (message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta, message_stop) and errors as ``{"type": "error", "error": ...}``.

Custom tools (``name``, ``description``, ``input_schema``) go through the chat path's tool machinery
(``server/tools.py``): ``tool_choice`` auto, any (a call is forced), tool (that one is forced) or
none; calls come back as ``tool_use`` blocks, their results go in as ``tool_result`` blocks. With
tools offered, a stream sends its content blocks when the answer is complete.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr

from flashtree.models.tokenizer import ChatTemplateOptions, encode_chat
from flashtree.server.errors import APIError
from flashtree.server.generation import (
    GenerationInput,
    ServedModel,
    _tokenize,
    sampling_from,
    structured_output,
    with_tools,
)
from flashtree.server.protocol import PositiveInt, _Request
from flashtree.server.stream import EngineFailure, GenerationDelta, RequestStream
from flashtree.server.tools import ToolPlan, read_answer, tool_plan


class TextBlock(_Request):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[StrictStr, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content if isinstance(block, TextBlock))

    def template_messages(self) -> list[dict[str, Any]]:
        """As chat template messages: tool results as tool messages (before the text), an assistant's
        tool_use blocks as its tool calls."""
        blocks = [] if isinstance(self.content, str) else self.content
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                   for b in blocks if isinstance(b, ToolResultBlock)]
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        return results + ([message] if message["content"] or calls or not results else [])


class CustomTool(_Request):
    type: Literal["custom"] | None = None  # (Anthropic's own tools: bash, computer, ... are not served)
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    input_schema: dict[StrictStr, Any]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False


class MessagesRequest(_Request):
    not_honoured = {
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
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(
            block.text for block in self.system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [entry for m in self.messages for entry in m.template_messages()]

    def tool_plan(self) -> ToolPlan | None:
        choice = self.tool_choice
        chat_choice: Any = None
        if choice is not None:
            if choice.type == "tool":
                if choice.name is None:
                    raise APIError(400, "tool_choice: a choice of type 'tool' needs the tool's name",
                                   param="tool_choice")
                chat_choice = {"type": "function", "function": {"name": choice.name}}
            else:
                chat_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in self.tools or ()]
        parallel = None if choice is None else not choice.disable_parallel_tool_use
        return tool_plan(tools, chat_choice, parallel)


def messages_input(body: MessagesRequest, model: ServedModel) -> GenerationInput:
    """The engine input of a Messages request (on the tokenizing thread)."""
    plan = body.tool_plan()
    messages, options = with_tools(body.chat_messages(), plan, ChatTemplateOptions(), model)
    prompt_ids = _tokenize(lambda: encode_chat(model.tokenizer, messages, options), "messages")
    structured = structured_output(plan, None, model, "tools", "tools")
    params = sampling_from("messages", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           max_tokens=body.max_tokens, stop=tuple(body.stop_sequences or ()), structured=structured)
    return GenerationInput(prompt_ids, params, None, tools=plan)


def content_blocks(final: GenerationDelta, tools: ToolPlan | None) -> tuple[list[dict[str, Any]], bool]:
    """The answer's content blocks (text, then tool_use blocks), and whether it called a tool."""
    content, calls = read_answer(tools, final.full_text or "")
    blocks = [{"type": "text", "text": content}] if content is not None and (content or not calls) else []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:  # (cut short by max_tokens)
            arguments = {}
        blocks.append({"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
                       "input": arguments if isinstance(arguments, dict) else {}})
    return blocks, bool(calls)


def stop_reason(final: GenerationDelta, stops: tuple[str, ...], called: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request (``called``: its answer calls a tool)."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    hit = stops_hit(final, stops)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def stops_hit(final: GenerationDelta, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the request (its text is cut just before it), if one did."""
    return final.stopped_by if isinstance(final.stopped_by, str) and final.stopped_by in stops else None


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_response(response_id: str, model: str, final: GenerationDelta, stops: tuple[str, ...],
                     tools: ToolPlan | None = None) -> dict:
    blocks, called = content_blocks(final, tools)
    reason, sequence = stop_reason(final, stops, called)
    return {"id": response_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": {"input_tokens": final.usage.prompt_tokens,
                                                 "output_tokens": final.usage.completion_tokens,
                                                 "cache_read_input_tokens": final.usage.cached_tokens}}


def event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def message_events(stream: RequestStream, response_id: str, model: str, prompt_tokens: int,
                         stops: tuple[str, ...], cancel: Callable[[RequestStream], None],
                         tools: ToolPlan | None = None) -> AsyncIterator[str]:
    """The Messages event sequence of one request; an engine failure ends it with an error event.
    With tools offered, the content blocks go out when the answer is complete."""
    start = {"id": response_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    incremental = tools is None or tools.mode == "none"
    opening = event("message_start", {"message": start})
    if incremental:
        opening += event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield opening + event("ping", {})
    try:
        async for batch in stream.batches():
            text = "".join(delta.text for delta in batch) if incremental else ""
            out = [event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})] if text else []
            last = batch[-1]
            if last.finished:
                blocks, called = content_blocks(last, tools)
                out += [event("content_block_stop", {"index": 0})] if incremental else [
                    e for index, block in enumerate(blocks) for e in _block_events(index, block)]
                reason, sequence = stop_reason(last, stops, called)
                out += [event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": {"output_tokens": last.usage.completion_tokens}}),
                        event("message_stop", {})]
            if out:
                yield "".join(out)
    except EngineFailure as err:
        yield event("error", {"error": {"type": "api_error", "message": str(err)}})
    finally:
        cancel(stream)


def _block_events(index: int, block: dict[str, Any]) -> list[str]:
    """One finished content block's start, delta and stop events."""
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    return [event("content_block_start", {"index": index, "content_block": start}),
            event("content_block_delta", {"index": index, "delta": delta}),
            event("content_block_stop", {"index": index})]
