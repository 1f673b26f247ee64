"""Structured output on the embedded SmolLM2 pair: JSON-schema answers parse and validate, the
speculative methods give the plain tokens under the schema (greedy and seeded), with either grammar
backend."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.structured import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                       "maxItems": 3}}}
CHATS = [[{"role": "user", "content": "Describe a software engineer as JSON: name, age, languages."}],
         [{"role": "user", "content": "Invent a person who writes Rust. Answer in JSON."}],
         [{"role": "user", "content": "What is the capital of France?"}]]
ENGINE = dict(max_running=4, max_context=512, adaptive_spec=False)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "languages"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and isinstance(value["languages"], list) and len(value["languages"]) <= 3
            and all(isinstance(x, str) for x in value["languages"]))


@pytest.fixture(scope="module")
def plain():
    torch.set_num_threads(2)
    return LLM("smollm2", spec="none", **ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize("method, budget", [("dflash", None), ("ddtree", 8)])
def test_json_schema_answers_validate_and_match_plain(plain, method, budget):
    spec = LLM("smollm2", spec=method, budget=budget, **ENGINE)
    schema = StructuredOutput.json_schema(SCHEMA)
    for params in (SamplingParams(max_tokens=96, structured=schema),
                   SamplingParams(max_tokens=96, temperature=0.8, seed=11, structured=schema)):
        want = plain.chat(CHATS, params)
        got = spec.chat(CHATS, params)
        for ref, out in zip(want, got):
            assert out.token_ids == ref.token_ids
            assert out.finish_reason == "stop" and _valid(out.text), out.text
        assert sum(o.mean_acceptance_length for o in got) / len(got) > 1.3  # speculation still pays


@pytest.mark.slow
def test_llguidance_is_lossless_too():
    """The other backend under DDTree gives its own plain tokens. (The backends' tokens differ: after
    "No," xgrammar allows " " then "be", llguidance only the canonical " because".)"""
    pattern = r"(Yes|No), because [a-z ,]{10,80}\."
    params = SamplingParams(max_tokens=40, structured=StructuredOutput("regex", pattern))
    plain = LLM("smollm2", spec="none", grammar_backend="llguidance", **ENGINE)
    tree = LLM("smollm2", spec="ddtree", budget=8, grammar_backend="llguidance", **ENGINE)
    want, got = plain.chat(CHATS, params), tree.chat(CHATS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(re.fullmatch(pattern, o.text) for o in got if o.finish_reason == "stop")
    assert sum(o.finish_reason == "stop" for o in got) >= 2
