"""What a request's output must look like: a JSON schema, any JSON object, a regex, one of a few
strings, or a grammar (structured output; ``flashtree/grammar/`` enforces it while decoding).

Glossary
- kind: ``json`` (a JSON schema, as JSON text), ``json_object`` (any JSON object), ``regex``,
  ``choice`` (exactly one of the given strings), ``grammar`` (EBNF as xgrammar reads it, the GBNF
  dialect of llama.cpp; Lark with the llguidance backend).
- value: the schema / regex / grammar text, or the choices (a tuple of strings); empty for json_object.
"""

from __future__ import annotations

import dataclasses
import json

from flashtree.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            choices = tuple(self.value) if not isinstance(self.value, str) else (self.value,)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise RequestError(f"choice must be a non-empty list of non-empty strings, got {self.value!r}")
            object.__setattr__(self, "value", choices)
        elif self.kind == "json":
            self._check_schema()
        elif self.kind != "json_object" and not (isinstance(self.value, str) and self.value):
            raise RequestError(f"{self.kind} must be a non-empty string, got {self.value!r}")

    def _check_schema(self) -> None:
        """The schema as canonical JSON text (a dict is accepted and serialized)."""
        value = self.value
        if isinstance(value, dict):
            value = json.dumps(value)
        try:
            schema = json.loads(value) if isinstance(value, str) else None
        except json.JSONDecodeError as exc:
            raise RequestError(f"json schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"json schema must be a JSON object, got {self.value!r}")
        object.__setattr__(self, "value", json.dumps(schema))  # (key order kept: properties come out in it)

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        return cls("json", schema)
