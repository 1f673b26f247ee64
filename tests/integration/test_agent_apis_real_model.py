"""The three APIs on the embedded model (SmolLM2 with its shipped drafter, DDTree as `serve` runs it):
the same greedy text for the same conversation through chat completions, Responses and Messages."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.support.server import ServerThread, server_config

CONVERSATION = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def served():
    from flashtree.speculative.defaults import default_spec

    method, draft = default_spec("smollm2", None, None)
    config = server_config("smollm2", method=method, draft=draft, max_running=4, max_context=512)
    with ServerThread(config) as running:
        yield running


def test_the_three_apis_give_the_same_greedy_text(served):
    assert served.method == "ddtree"
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)
    chat = api.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24, temperature=0)
    response = api.responses.create(model="tiny", input=CONVERSATION, max_output_tokens=24, temperature=0)
    message = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=120).messages.create(
        model="tiny", max_tokens=24, messages=CONVERSATION, extra_body={"temperature": 0})
    text = chat.choices[0].message.content
    assert text and response.output_text == text and message.content[0].text == text
