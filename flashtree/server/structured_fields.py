"""The request fields that ask for structured output, in the shapes clients send them, as one
:class:`~flashtree.structured.StructuredOutput`.

- OpenAI chat / completions: ``response_format`` ``{"type": "json_object"}`` or ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}`` (``{"type": "text"}``: none).
- vLLM's extensions: ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, and the newer ``structured_outputs`` object with the same
  keys (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``).
- OpenAI Responses: ``text.format``, the json_schema fields flattened into it.

At most one of them per request; two are a 400 that names both.
"""

from __future__ import annotations

import json
from typing import Any

from flashtree.errors import RequestError
from flashtree.server.errors import APIError
from flashtree.server.protocol import ResponseFormat, StructuredOutputs, TextOptions
from flashtree.structured import StructuredOutput


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _of_format(kind: str, schema: dict[str, Any] | None, field: str) -> StructuredOutput | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if schema is None:
        raise APIError(400, f"{field}: a json_schema format needs its schema", param=field)
    return StructuredOutput("json", _schema_text(schema))


def requested(body: Any) -> StructuredOutput | None:
    """The structured output a chat / completions request asks for (None: free text)."""
    asked: dict[str, StructuredOutput] = {}
    try:
        _collect(body, asked)
    except RequestError as err:
        raise APIError(400, str(err), param=next(iter(asked), "response_format")) from None
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)}: ask for one kind of structured output, not several",
                       param=next(iter(asked)))
    return next(iter(asked.values()), None)


def _collect(body: Any, asked: dict[str, StructuredOutput | None]) -> None:
    fmt: ResponseFormat | None = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _of_format(fmt.type, fmt.json_schema.json_schema if fmt.json_schema else None,
                          "response_format.json_schema")
        if spec is not None:
            asked["response_format"] = spec
    if getattr(body, "guided_json", None) is not None:
        asked["guided_json"] = StructuredOutput("json", _schema_text(body.guided_json))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, name, None) is not None:
            asked[name] = StructuredOutput(kind, getattr(body, name))
    outputs: StructuredOutputs | None = getattr(body, "structured_outputs", None)
    if outputs is not None:
        for key, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            value = getattr(outputs, key)
            if value is not None:
                asked[f"structured_outputs.{key.rstrip('_')}"] = StructuredOutput(
                    kind, _schema_text(value) if kind == "json" else value)
        if outputs.json_object:
            asked["structured_outputs.json_object"] = StructuredOutput("json_object")


def from_text_options(text: TextOptions | None) -> StructuredOutput | None:
    """The Responses API's ``text.format``."""
    if text is None or text.format is None:
        return None
    try:
        return _of_format(text.format.type, text.format.json_schema, "text.format")
    except RequestError as err:
        raise APIError(400, str(err), param="text.format") from None
