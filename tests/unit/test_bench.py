"""The benchmark's inputs: the method list (plain first, validated) and the prompt sources.
(Benchmark runs: tests/integration/test_bench.py.)"""

from __future__ import annotations

import pytest

from flashtree.bench.datasets import humaneval_prompts, jsonl_prompts
from flashtree.bench.methods import parse_methods
from flashtree.errors import ConfigError


def test_parse_methods_puts_plain_first_and_validates():
    parsed = parse_methods("ddtree:64,dflash")
    assert [m.label for m in parsed] == ["ar", "ddtree:64", "dflash"]
    assert parsed[1].budget == 64 and parsed[2].spec_method == "dflash"
    for bad in ("ddtree:0", "ddtree:x", "medusa", "ar,ar", ""):
        with pytest.raises(ConfigError):
            parse_methods(bad)


def test_prompt_sources(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        jsonl_prompts(bad)
    problems = humaneval_prompts(2)
    assert len(problems) == 2 and "def " in problems[0].messages[0]["content"]
