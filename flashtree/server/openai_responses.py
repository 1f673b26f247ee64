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

from pydantic import Field, StrictBool, StrictInt, StrictStr

from flashtree.models.tokenizer import encode_chat
from flashtree.server.async_engine import (
    EngineFailure,
    GenerationDelta,
    RequestStream,
    RequestUsage,
)
from flashtree.server.errors import APIError
from flashtree.server.generation import (
    GenerationInput,
    ServedModel,
    _tokenize,
    checked,
    sampling_from,
)
from flashtree.server.protocol import PositiveInt, Temperature, TextOptions, UnitInterval, _Request
from flashtree.server.structured_fields import from_text_options


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputText]

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponsesRequest(_Request):
    not_honoured = {
        "tools": ((None, []), "tools are not served yet"),
        "tool_choice": ((None, "none", "auto"), "tools are not served yet"),
        "reasoning": ((None,), "reasoning settings are not served"),
        "background": ((None, False), "background responses are not served"),
        "truncation": ((None, "disabled"), "only truncation 'disabled' is served"),
        "include": ((None, []), "include is not served"),
    }
    model: StrictStr
    input: StrictStr | Annotated[list[InputMessage], Field(min_length=1)]
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

    def input_messages(self) -> list[dict[str, str]]:
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
                    ) -> tuple[GenerationInput, list[dict[str, str]]]:
    """The engine input and the conversation (without instructions: they are not carried over)."""
    history = [] if body.previous_response_id is None else store.get(body.previous_response_id,
                                                                     "previous_response_id")[1]
    conversation = history + body.input_messages()
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    prompt_ids = _tokenize(lambda: encode_chat(model.tokenizer, head + conversation), "input")
    max_tokens = body.max_output_tokens or max(1, model.max_context - len(prompt_ids))
    structured = checked(from_text_options(body.text), model, "text.format")
    params = sampling_from("input", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           max_tokens=max_tokens, seed=body.seed, ignore_eos=body.ignore_eos, structured=structured)
    return GenerationInput(prompt_ids, params, None), conversation


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


def response_object(ids: ResponseIds, body: ResponsesRequest, model: str, status: str, text: str | None,
                    usage: RequestUsage | None = None, finish_reason: str | None = None) -> dict[str, Any]:
    """A ``response`` object; ``text`` None: no output yet (a stream's first events)."""
    incomplete = status == "completed" and finish_reason == "length"
    output = [] if text is None else [message_item(ids, text, "completed")]
    return {
        "id": ids.response, "object": "response", "created_at": ids.created, "model": model,
        "status": "incomplete" if incomplete else status, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": False, "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": body.temperature, "top_p": body.top_p, "text": _text_options(body),
        "tool_choice": "none", "tools": [], "truncation": "disabled", "user": body.user,
        "usage": None if usage is None else {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def message_item(ids: ResponseIds, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [output_text(text)]
    return {"type": "message", "id": ids.message, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def finished_response(ids: ResponseIds, body: ResponsesRequest, model: str, final: GenerationDelta,
                      conversation: list[dict[str, str]], store: ResponseStore) -> dict[str, Any]:
    """The completed response object, stored with its conversation when the request asked."""
    text = final.full_text or ""
    response = response_object(ids, body, model, "completed", text, final.usage, final.finish_reason)
    if body.store:
        store.put(response, conversation + [{"role": "assistant", "content": text}])
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
                          conversation: list[dict[str, str]], store: ResponseStore,
                          cancel: Callable[[RequestStream], None]) -> AsyncIterator[str]:
    """created, in_progress, output_item.added, content_part.added, output_text.delta..., then
    output_text.done, content_part.done, output_item.done and completed."""
    event = _Events()
    where = {"item_id": ids.message, "output_index": 0, "content_index": 0}
    yield (event("response.created", response=response_object(ids, body, model, "in_progress", None))
           + event("response.in_progress", response=response_object(ids, body, model, "in_progress", None))
           + event("response.output_item.added", output_index=0, item=message_item(ids, "", "in_progress"))
           + event("response.content_part.added", **where, part=output_text("")))
    text = ""
    try:
        async for batch in stream.batches():
            out = []
            for delta in batch:
                if delta.text:
                    text += delta.text
                    out.append(event("response.output_text.delta", **where, delta=delta.text, logprobs=[]))
            last = batch[-1]
            if last.finished:
                final = finished_response(ids, body, model, last, conversation, store)
                done_text = final["output"][0]["content"][0]["text"]
                out += [event("response.output_text.done", **where, text=done_text, logprobs=[]),
                        event("response.content_part.done", **where, part=output_text(done_text)),
                        event("response.output_item.done", output_index=0, item=final["output"][0]),
                        event("response.completed" if final["status"] == "completed" else "response.incomplete",
                              response=final)]
            if out:
                yield "".join(out)
    except EngineFailure as err:
        failed = response_object(ids, body, model, "failed", None)
        failed["error"] = {"code": "server_error", "message": str(err)}
        yield event("response.failed", response=failed)
    finally:
        cancel(stream)
