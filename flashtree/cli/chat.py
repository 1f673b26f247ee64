"""Interactive terminal chat that streams tokens as the engine commits them."""

from __future__ import annotations

import sys

from flashtree.llm import LLM
from flashtree.models.tokenizer import encode_chat
from flashtree.sampling import SamplingParams


def stream_reply(llm: LLM, messages: list[dict], params: SamplingParams, out=sys.stdout) -> str:
    """Generate one assistant turn, writing text deltas to ``out``; returns the whole reply."""
    engine = llm.engine
    req = engine.add_request(encode_chat(llm.tokenizer, messages), params)
    while not req.finished:
        for event in engine.step():
            if event.request is req and event.new_text:
                out.write(event.new_text)
                out.flush()
    out.write("\n")
    return req.text


def run_chat(llm: LLM, params: SamplingParams, system: str | None = None, inp=sys.stdin, out=sys.stdout) -> None:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    out.write("flashtree chat: type a message, an empty line or Ctrl-D to quit.\n")
    while True:
        out.write("> ")
        out.flush()
        line = inp.readline()
        if not line or not line.strip():
            return
        messages.append({"role": "user", "content": line.strip()})
        reply = stream_reply(llm, messages, params, out)
        messages.append({"role": "assistant", "content": reply})
