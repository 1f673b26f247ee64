"""The playground at / in a real browser (Debian's chromium driven by Playwright): a chat answer
streams in with the same text as the API gives, its rounds and its last draft tree drawn; and the
speculation trace it reads is right (rounds add up to the tokens, the tree's accepted path is its
own)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.dflash_helpers import tiny_pair
from tests.support.browser import chat_in_playground
from tests.support.server import ServerThread, server_config
from tests.support.workload import BLOCK, VOCAB

PROMPT = "hello flash tree"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("playground"), vocab=VOCAB, block_size=BLOCK)
    config = server_config(pair.target, method="ddtree", draft=str(pair.drafter), budget=8, recent_trees=4,
                           max_running=4, max_context=96, adaptive_spec=False)
    with ServerThread(config) as running:
        yield running


def _stream(served, **extra) -> list[dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0,
            "stream": True, **extra}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_the_speculation_trace_adds_up(served):
    chunks = _stream(served, speculation_trace=True, stream_options={"include_usage": True})
    usage = chunks[-1]["usage"]
    traced = [c["speculation"] for c in chunks if "speculation" in c]
    rounds = [n for s in traced for n in s["rounds"]]
    assert len(rounds) == usage["rounds"] and sum(rounds) >= usage["completion_tokens"] - 1  # (the first: prefill)
    trees = [s["tree"] for s in traced if "tree" in s]
    assert trees
    for tree in trees:
        assert len(tree["tokens"]) == len(tree["parents"]) == len(tree["texts"]) and tree["parents"][0] == -1
        path = tree["accepted_path"]
        assert path[0] == 0 and all(tree["parents"][b] == a for a, b in zip(path, path[1:]))
    plain = _stream(served)
    assert not any("speculation" in c for c in plain)  # only when asked
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in plain if c.get("choices"))
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def test_the_playground_chats_and_draws_rounds_and_trees(served, tmp_path):
    expected = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=256, temperature=0)
    answer = chat_in_playground(served.url, PROMPT, tmp_path / "playground.png", "tiny")
    assert answer.text == expected.choices[0].message.content
    assert len(answer.rounds) == expected.usage.rounds and all(n >= 1 for n in answer.rounds)
    assert answer.tree_nodes >= 2 and not answer.page_errors  # the root and drafted nodes
