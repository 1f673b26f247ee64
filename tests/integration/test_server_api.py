"""What a user of the OpenAI API expects from the server: fields honoured or refused by name (never
dropped), bounded sampling settings, tokenize / detokenize / model / version endpoints, a body-size
limit, tokenization off the event loop, and a clear exit when the port is taken."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from flashtree.cli.serve import check_address_free
from flashtree.errors import AddressInUseError
from flashtree.llm import LLM
from flashtree.models.tokenizer import encode_chat
from flashtree.sampling import SamplingParams
from flashtree.version import __version__
from tests.support.server import ServerThread, after_cancel, hold_rounds, save_tiny_chat_model, server_config

LIMIT = 4096  # --max-request-bytes of the test server
ENGINE_LIMITS = dict(max_running=4, max_context=128, prefill_chunk=8, max_waiting=64, prefix_caching=True, page_size=4)
CHAT = [{"role": "user", "content": "hello world , how is the cat ?"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = save_tiny_chat_model(tmp_path_factory.mktemp("api") / "target")
    config = dataclasses.replace(server_config(target, **ENGINE_LIMITS), max_request_bytes=LIMIT)
    with ServerThread(config) as running:
        yield running


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def post(server: ServerThread, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


# ---------------------------------------------------------------------------- fields
@pytest.mark.parametrize("field,value", [
    ("structural_tag", {"type": "structural_tag"}), ("guided_decoding_backend", "outlines"),
    ("functions", [{"name": "f"}]), ("prompt_logprobs", 1), ("echo", True),
    ("min_p", 0.1), ("include_stop_str_in_output", True), ("best_of", 2),
])
def test_chat_fields_not_served_are_refused_by_name(served, field, value):
    response = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ") and repr(value) in error["message"]


@pytest.mark.parametrize("off", [{"repetition_penalty": 1.0}, {"response_format": {"type": "text"}}, {"n": 1},
                                 {"min_tokens": 0}, {"logprobs": False}, {"tool_choice": "none"}, {"user": "u-1"},
                                 {"presence_penalty": 0}])
def test_the_off_value_of_such_a_field_is_accepted(served, off):
    response = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2, **off})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field,value", [("temperature", 100), ("temperature", 2.5), ("temperature", float("inf")),
                                         ("top_p", float("nan")), ("top_k", 10_000)])
def test_sampling_settings_are_bounded(served, field, value):
    body = json.dumps({"model": "tiny", "prompt": "hi", field: value})  # (Infinity / NaN as Python writes them)
    response = httpx.post(f"{served.url}/v1/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_stop_token_ids_end_the_answer_at_that_token(served):
    free = client(served).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, **GREEDY)
    ids = post(served, "/tokenize", {"prompt": free.choices[0].text}).json()["tokens"]
    stop = ids[3]
    stopped = client(served).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == ids.index(stop) + 1


def test_truncate_prompt_tokens_keeps_the_prompt_s_tail(served):
    too_long = list(range(1, 90)) * 2  # 178 tokens: more than the context holds
    with pytest.raises(openai.BadRequestError, match="context"):
        client(served).completions.create(model="tiny", prompt=too_long, max_tokens=4, **GREEDY)
    out = client(served).completions.create(model="tiny", prompt=too_long, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True, "truncate_prompt_tokens": 50})
    tail = client(served).completions.create(model="tiny", prompt=too_long[-50:], max_tokens=4, **GREEDY)
    assert out.usage.prompt_tokens == 50 and out.choices[0].text == tail.choices[0].text


def test_echo_starts_the_completion_with_the_prompt(served):
    plain = client(served).completions.create(model="tiny", prompt="the cat", max_tokens=5, **GREEDY)
    echoed = client(served).completions.create(model="tiny", prompt="the cat", max_tokens=5, echo=True, **GREEDY)
    assert echoed.choices[0].text == "the cat" + plain.choices[0].text
    stream = client(served).completions.create(model="tiny", prompt="the cat", max_tokens=5, echo=True, stream=True,
                                               **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_chat_template_options_are_the_template_s(served):
    """add_generation_prompt, continue_final_message, chat_template and its variables reach the
    template as transformers applies them; the chat endpoint answers them."""
    tokenizer = served.tokenizer()
    conversation = CHAT + [{"role": "assistant", "content": "the cat"}]
    cases = [(dict(add_generation_prompt=False), dict(add_generation_prompt=False)),
             (dict(add_generation_prompt=False, continue_final_message=True),
              dict(add_generation_prompt=False, continue_final_message=True))]
    for options, expected in cases:
        got = post(served, "/tokenize", {"messages": conversation, **options}).json()["tokens"]
        assert got == list(tokenizer.apply_chat_template(conversation, tokenize=True, **expected)["input_ids"])
        answer = post(served, "/v1/chat/completions", {"model": "tiny", "messages": conversation, "max_tokens": 3,
                                                       **options})
        assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == len(got)
    template = "{% for m in messages %}[{{ m['role'] }}|{{ shout }}]{{ m['content'] }}{% endfor %}"
    answer = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2,
                                                   "chat_template": template, "chat_template_kwargs": {"shout": "x"}})
    expected = tokenizer.apply_chat_template(CHAT, chat_template=template, shout="x", tokenize=True,
                                             add_generation_prompt=True)["input_ids"]
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # last is the user's
    ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
])
def test_chat_template_options_that_cannot_work_are_refused(served, body, param):
    response = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# ---------------------------------------------------------------------------- log-probabilities
def test_chat_logprobs_are_the_engine_s_in_openai_s_shape(served):
    """Whole and streamed answers carry the same values, one per completion token, with the asked
    number of alternatives, and they are the engine's own (``tests/integration/test_logprobs.py``
    checks those against the target)."""
    asked = dict(max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY)
    whole = client(served).chat.completions.create(model="tiny", messages=CHAT, **asked)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode()) and entry.top_logprobs[0].bytes == entry.bytes
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    stream = client(served).chat.completions.create(model="tiny", messages=CHAT, stream=True, **asked)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    prompt_ids = post(served, "/tokenize", {"messages": CHAT}).json()["tokens"]
    own = LLM(config=served.engine.config).generate([prompt_ids], SamplingParams(max_tokens=8, ignore_eos=True,
                                                                                 logprobs=3))[0]
    assert [r.logprob for r in own.logprobs] == pytest.approx([e.logprob for e in content], abs=1e-6)
    without = client(served).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, **GREEDY)
    assert without.choices[0].logprobs is None and without.choices[0].message.content == whole.choices[0].message.content


def test_completion_logprobs_have_offsets_and_the_chosen_token(served):
    whole = client(served).completions.create(model="tiny", prompt="the cat", max_tokens=6, logprobs=2, **GREEDY)
    values = whole.choices[0].logprobs
    assert len(values.tokens) == len(values.token_logprobs) == len(values.top_logprobs) == 6
    assert values.text_offset == [sum(len(t) for t in values.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(values.tokens, values.token_logprobs, values.top_logprobs):
        assert top[token] == logprob and len(top) == 2  # greedy: the chosen token is among the top 2
    stream = client(served).completions.create(model="tiny", prompt="the cat", max_tokens=6, logprobs=2, stream=True,
                                               **GREEDY)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == values.tokens
    assert [o for c in chunks for o in c.text_offset] == values.text_offset


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 1, "echo": True}, "logprobs"),
])
def test_logprobs_requests_that_cannot_be_served_are_refused(served, path, body, param):
    response = post(served, path, {"model": "tiny", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# ---------------------------------------------------------------------------- endpoints
def test_tokenize_and_detokenize_round_trip(served):
    tokens = post(served, "/tokenize", {"model": "tiny", "prompt": "how is the cat ?"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == ENGINE_LIMITS["max_context"]
    assert tokens["tokens"] == served.tokenizer().encode("how is the cat ?", add_special_tokens=False)
    assert post(served, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "how is the cat ?"
    assert post(served, "/tokenize", {"prompt": "a", "messages": CHAT}).status_code == 400
    bad = post(served, "/detokenize", {"tokens": [1, 100000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(served, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404


def test_model_and_version_endpoints(served):
    card = client(served).models.retrieve("tiny")
    assert card.id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(served).models.retrieve("gpt-4")
    assert httpx.get(f"{served.url}/version").json() == {"version": __version__}


def test_version_flag():
    run = subprocess.run([sys.executable, "-m", "flashtree.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"flashtree {__version__}"


# ---------------------------------------------------------------------------- robustness
def test_a_body_over_the_limit_is_413_before_or_while_it_is_read(served):
    big = {"model": "tiny", "prompt": "cat " * LIMIT}
    declared = post(served, "/v1/completions", big)  # httpx sends its Content-Length
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        payload = json.dumps(big).encode()
        for start in range(0, len(payload), 1000):
            yield payload[start:start + 1000]

    streamed = httpx.post(f"{served.url}/v1/completions", content=chunks(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413, streamed.text
    assert client(served).completions.create(model="tiny", prompt="hi", max_tokens=2).choices  # still serving


def test_tokenization_runs_off_the_event_loop(served, monkeypatch):
    """A request whose tokenization does not finish holds up no other request: the other one is
    tokenized and answered meanwhile (the slow one waits on an event the answer sets; were it on the
    event loop, nothing else would run and this test would time out)."""
    import flashtree.server.routes as routes

    release, answered, slow_started = threading.Event(), threading.Event(), threading.Event()
    real = routes.completion_input

    def completion_input(body, model):
        if body.prompt == "slow":
            slow_started.set()
            assert release.wait(30)
        return real(body, model)

    monkeypatch.setattr(routes, "completion_input", completion_input)
    ctx = served.app.state.flashtree
    monkeypatch.setattr(ctx, "tokenizing", type(ctx.tokenizing)(max_workers=2))  # (one thread waits in the slow one)
    results = {}

    def send(prompt):
        results[prompt] = post(served, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3})
        if prompt == "fast":
            answered.set()
            release.set()

    slow = threading.Thread(target=send, args=("slow",))
    slow.start()
    assert slow_started.wait(30)
    send("fast")
    slow.join(60)
    assert answered.is_set() and results["fast"].status_code == 200 and results["slow"].status_code == 200


def test_a_client_that_leaves_a_whole_response_logs_no_error(served, monkeypatch, caplog):
    """A non-streaming client gives up (its read times out) while its request's rounds wait: the
    request is aborted, and the server logs no error (it once logged an InvalidStateError)."""
    left = threading.Event()
    hold_rounds(served.engine, monkeypatch, left)
    after_cancel(served, monkeypatch, left.set)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 100,
                                                          "ignore_eos": True}, timeout=0.2)
    assert left.wait(30)
    monkeypatch.undo()
    assert client(served).completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    assert not [r for r in caplog.records if r.levelname == "ERROR" or "InvalidStateError" in r.getMessage()]


def test_a_taken_port_is_a_one_line_error_and_exit_status_1(tmp_path):
    target = save_tiny_chat_model(tmp_path / "target")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(AddressInUseError, match=f"127.0.0.1:{port}"):
            check_address_free("127.0.0.1", port)
        run = subprocess.run([sys.executable, "-m", "flashtree.cli", "serve", "--model", str(target), "--device", "cpu",
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"flashtree: error: cannot listen on 127.0.0.1:{port}")


# ---------------------------------------------------------------------------- prefix cache
def test_a_repeated_prompt_reports_its_cached_tokens_and_the_hit_rate(served):
    messages = [{"role": "system", "content": "you are a cat . " * 6}, {"role": "user", "content": "hello"}]
    first, second = (client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=3, **GREEDY)
                     for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached < second.usage.prompt_tokens
    metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("flashtree_prefix_cache_hit_tokens "))
    assert hits >= cached and "flashtree_prefix_cache_hit_rate" in metrics


# ---------------------------------------------------------------------------- penalties, min_tokens
def test_penalties_and_min_tokens_are_served_as_offline(served):
    settings = dict(frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3, "min_tokens": 6,
                                                                              "ignore_eos": True})
    got = client(served).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, **settings)
    plain = client(served).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, **GREEDY)
    prompt = encode_chat(served.engine.tokenizer, CHAT)
    offline = LLM(config=served.engine.config).generate([prompt], SamplingParams(
        max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
        min_tokens=6))[0]
    assert got.choices[0].message.content == offline.text != plain.choices[0].message.content


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                         ("min_tokens", -1), ("min_tokens", 50)])
def test_bad_penalties_are_refused_by_name(served, field, value):
    response = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 10, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


# ---------------------------------------------------------------------------- n > 1
def test_n_choices_are_the_seeded_requests_and_share_the_prompt(served):
    messages = [{"role": "system", "content": "you are a cat . " * 6}, {"role": "user", "content": "sing"}]
    hits_before = served.engine.prefix_cache.hit_tokens
    got = client(served).chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=3, temperature=1.0,
                                                 seed=5, extra_body={"ignore_eos": True})
    prompt = encode_chat(served.engine.tokenizer, messages)
    offline = LLM(config=served.engine.config).generate(
        [prompt] * 3, [SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)])
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [o.text for o in offline]
    assert len({c.message.content for c in got.choices}) > 1
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 30
    assert served.engine.prefix_cache.hit_tokens - hits_before >= 2 * 4 * ((len(prompt) - 1) // 4)  # the siblings'


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_n_choices_stream_interleaved_by_index(served, kind):
    api = client(served)
    common = dict(model="tiny", max_tokens=8, n=2, temperature=0.9, seed=3, extra_body={"ignore_eos": True})
    if kind == "chat":
        whole = api.chat.completions.create(messages=CHAT, **common)
        chunks = list(api.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True},
                                                  **common))
        texts, expected = ["", ""], [c.message.content for c in whole.choices]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        whole = api.completions.create(prompt="hello world", **common)
        chunks = list(api.completions.create(prompt="hello world", stream=True, stream_options={"include_usage": True},
                                             **common))
        texts, expected = ["", ""], [c.text for c in whole.choices]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    assert texts == expected
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1] and chunks[-1].usage.completion_tokens == 16


def test_too_many_choices_are_refused_by_name(served):
    response = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 17})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
