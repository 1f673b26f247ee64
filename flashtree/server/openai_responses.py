"""OpenAI's Responses API (``/v1/responses``), a thin adapter over the chat completions path.

``input`` (a string or message items) after the ``instructions`` becomes the chat template's
messages, and its sampling fields a :class:`~flashtree.sampling.SamplingParams`; the engine request,
its stream and its end are the chat path's. With ``store`` (the default, as OpenAI's), the response
and its conversation are kept in a bounded in-memory store (least recently used out first), so a
later request can continue it with ``previous_response_id`` and ``GET`` / ``DELETE
/v1/responses/{id}`` find it; an unknown or evicted id is a 404 that says so.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

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
from flashtree.server.protocol import (
    ChatMessage,
    FunctionCall,
    MessageToolCall,
    PositiveInt,
    Temperature,
    TextOptions,
    UnitInterval,
    _Request,
)
from flashtree.server.stream import EngineFailure, GenerationDelta, RequestStream, RequestUsage
from flashtree.server.structured_fields import from_text_options
from flashtree.server.tools import ToolCall, ToolPlan, read_answer, tool_plan


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputText]

    def as_template_dict(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class FunctionCallItem(_Request):
    """A call the model made, sent back in the conversation."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr

    def as_template_dict(self) -> dict[str, Any]:
        call = MessageToolCall(id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments))
        return ChatMessage(role="assistant", content=None, tool_calls=[call]).as_template_dict()


class FunctionCallOutputItem(_Request):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr

    def as_template_dict(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


def _item_type(value: Any) -> str:
    """An input item's kind: its ``type`` (a message may leave it out)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(_Request):
    """A Responses function tool: the chat tool's function fields, flat."""

    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


class FunctionChoice(_Request):
    type: Literal["function"]
    name: StrictStr


class ResponsesRequest(_Request):
    not_honoured = {
        "reasoning": ((None,), "reasoning settings are not served"),
        "background": ((None, False), "background responses are not served"),
        "truncation": ((None, "disabled"), "only truncation 'disabled' is served"),
        "include": ((None, []), "include is not served"),
    }
    model: StrictStr
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: UnitInterval = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    seed: StrictInt | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    text: TextOptions | None = None  # text.format: structured output (json_schema, json_object)
    tools: list[FunctionTool] | None = None  # function tools only (server/tools.py)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def tool_plan(self) -> ToolPlan | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        return tool_plan([t.as_chat_tool() for t in self.tools or ()], choice, self.parallel_tool_calls)

    def input_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [item.as_template_dict() for item in self.input]


class ResponseStore:
    """Stored responses by id: (the response object, the conversation it ends), least recently
    used out first beyond ``capacity``. Safe to use from the event loop and the tokenizing thread."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict[str, str]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict[str, str]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, field: str = "response_id") -> tuple[dict, list[dict[str, str]]]:
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                raise APIError(404, f"{field}: no stored response {response_id!r} (unknown, deleted, or evicted from "
                                    f"the store of the {self.capacity} most recent)", param=field, code="not_found")
            self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)


def responses_input(body: ResponsesRequest, model: ServedModel, store: ResponseStore
                    ) -> tuple[GenerationInput, list[dict[str, Any]]]:
    """The engine input and the conversation (without instructions: they are not carried over)."""
    history = [] if body.previous_response_id is None else store.get(body.previous_response_id,
                                                                     "previous_response_id")[1]
    conversation = history + body.input_messages()
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    plan = body.tool_plan()
    messages, options = with_tools(head + conversation, plan, ChatTemplateOptions(), model)
    prompt_ids = _tokenize(lambda: encode_chat(model.tokenizer, messages, options), "input")
    max_tokens = body.max_output_tokens or max(1, model.max_context - len(prompt_ids))
    structured = structured_output(plan, from_text_options(body.text), model, "text.format", "text.format")
    params = sampling_from("input", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           max_tokens=max_tokens, seed=body.seed, ignore_eos=body.ignore_eos, structured=structured)
    return GenerationInput(prompt_ids, params, None, tools=plan), conversation


def _text_options(body: ResponsesRequest) -> dict[str, Any]:
    """The ``text`` field a response echoes: the request's format (text by default)."""
    if body.text is None or body.text.format is None:
        return {"format": {"type": "text"}}
    return {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}


class ResponseIds:
    def __init__(self):
        self.response = f"resp_{uuid.uuid4().hex[:24]}"
        self.message = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())


def response_object(ids: ResponseIds, body: ResponsesRequest, model: str, status: str,
                    output: list[dict[str, Any]] | None, usage: RequestUsage | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """A ``response`` object with its output items (None: no output yet, a stream's first events)."""
    incomplete = status == "completed" and finish_reason == "length"
    output = output or []
    return {
        "id": ids.response, "object": "response", "created_at": ids.created, "model": model,
        "status": "incomplete" if incomplete else status, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": body.temperature, "top_p": body.top_p, "text": _text_options(body),
        "tool_choice": _tool_choice(body), "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "truncation": "disabled", "user": body.user,
        "usage": None if usage is None else {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return choice.model_dump()
    return choice or ("auto" if body.tools else "none")


def function_call_item(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def output_items(ids: ResponseIds, text: str, tools: ToolPlan | None) -> tuple[list[dict[str, Any]], list[ToolCall]]:
    """The answer as output items (a message for its content, a function_call per call), and the calls."""
    content, calls = read_answer(tools, text)
    items = [message_item(ids, content, "completed")] if content is not None and (content or not calls) else []
    return items + [function_call_item(call) for call in calls], calls


def message_item(ids: ResponseIds, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text)]
    return {"type": "message", "id": ids.message, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def finished_response(ids: ResponseIds, body: ResponsesRequest, model: str, final: GenerationDelta,
                      conversation: list[dict[str, Any]], store: ResponseStore, tools: ToolPlan | None = None
                      ) -> dict[str, Any]:
    """The completed response object, stored with its conversation when the request asked."""
    items, calls = output_items(ids, final.full_text or "", tools)
    response = response_object(ids, body, model, "completed", items, final.usage, final.finish_reason)
    if body.store:
        content = next((i["content"][0]["text"] for i in items if i["type"] == "message"), None)
        turn = {"role": "assistant", "content": content or ""}
        if calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                 "arguments": c.arguments}}
                                  for c in calls]
        store.put(response, conversation + [turn])
    return response


class _Events:
    """Responses stream events, numbered in order."""

    def __init__(self):
        self.number = 0

    def __call__(self, kind: str, **payload) -> str:
        body = {"type": kind, "sequence_number": self.number, **payload}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def response_events(stream: RequestStream, ids: ResponseIds, body: ResponsesRequest, model: str,
                          conversation: list[dict[str, Any]], store: ResponseStore,
                          cancel: Callable[[RequestStream], None], tools: ToolPlan | None = None
                          ) -> AsyncIterator[str]:
    """created, in_progress, output_item.added, content_part.added, output_text.delta..., then
    output_text.done, content_part.done, output_item.done and completed. With tools offered, the
    output items (a message, function calls) are read from the whole answer and sent at its end."""
    event = _Events()
    yield (event("response.created", response=response_object(ids, body, model, "in_progress", None))
           + event("response.in_progress", response=response_object(ids, body, model, "in_progress", None)))
    incremental = tools is None or tools.mode == "none"
    where = {"item_id": ids.message, "output_index": 0, "content_index": 0}
    if incremental:
        yield (event("response.output_item.added", output_index=0, item=message_item(ids, "", "in_progress"))
               + event("response.content_part.added", **where, part=output_text("")))
    try:
        async for batch in stream.batches():
            out = [event("response.output_text.delta", **where, delta=d.text, logprobs=[])
                   for d in batch if d.text and incremental]
            last = batch[-1]
            if last.finished:
                final = finished_response(ids, body, model, last, conversation, store, tools)
                items = final["output"]
                out += _message_done(event, where, items[0]) if incremental else [
                    e for index, item in enumerate(items) for e in _item_events(event, index, item)]
                out.append(event("response.completed" if final["status"] == "completed" else "response.incomplete",
                                 response=final))
            if out:
                yield "".join(out)
    except EngineFailure as err:
        failed = response_object(ids, body, model, "failed", None)
        failed["error"] = {"code": "server_error", "message": str(err)}
        yield event("response.failed", response=failed)
    finally:
        cancel(stream)


def _message_done(event: _Events, where: dict[str, Any], item: dict[str, Any]) -> list[str]:
    text = item["content"][0]["text"]
    return [event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=output_text(text)),
            event("response.output_item.done", output_index=where["output_index"], item=item)]


def _item_events(event: _Events, index: int, item: dict[str, Any]) -> list[str]:
    """The whole event sequence of one finished output item (a message or a function call)."""
    if item["type"] == "message":
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text = item["content"][0]["text"]
        return [event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                              "content": []}),
                event("response.content_part.added", **where, part=output_text("")),
                event("response.output_text.delta", **where, delta=text, logprobs=[]),
                *_message_done(event, where, item)]
    where = {"item_id": item["id"], "output_index": index}
    return [event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                          "arguments": ""}),
            event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            event("response.output_item.done", output_index=index, item=item)]
