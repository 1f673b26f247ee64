"""``flashtree serve --engine-process``: the engine in a process of its own, behind the real uvicorn
server and the official ``openai`` client (tiny random model, CPU). The endpoints' own behaviour in this
mode is covered by tests/integration/test_server.py's ``*-process`` servers; this file covers what
the process adds: the same tokens as an engine thread, streams that leave, the HTTP side's grammar
check, a crash of the engine process and a load that fails in it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from flashtree.errors import FlashtreeError
from tests.support.server import ServerThread, metric_value, save_tiny_chat_model, server_config

LIMITS = dict(max_running=4, max_context=2048, prefill_chunk=16, max_waiting=64)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
PROMPTS = ["hello world , how is the cat ?", "the red sun and the blue sea", "one two three four",
           "why is the sky blue ?", "a big dog ran to the house", "what was the moon"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("engine_process") / "target")


@pytest.fixture(scope="module")
def process_server(target):
    with ServerThread(dataclasses.replace(server_config(target, **LIMITS), engine_process=True)) as running:
        yield running


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics_text(server: ServerThread) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def wait_for_metric(server, name: str, labels: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while not predicate(value := metric_value(metrics_text(server), name, labels)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def concurrent_streams(server: ServerThread, max_tokens: int) -> list[str]:
    """Each prompt streamed at once (more streams than slots: some wait), texts in prompt order."""
    async def one(aclient, prompt):
        chunks = await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                       max_tokens=max_tokens, stream=True, **GREEDY)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*[one(aclient, p) for p in PROMPTS])

    return asyncio.run(run())


def test_an_engine_process_streams_the_tokens_an_engine_thread_streams(process_server, target):
    assert process_server.engine is None  # (the engine lives in the other process)
    with ServerThread(server_config(target, **LIMITS)) as thread_server:
        expected = concurrent_streams(thread_server, max_tokens=24)
    assert concurrent_streams(process_server, max_tokens=24) == expected
    assert all(expected) and len(set(expected)) > 1
    text = metrics_text(process_server)  # the engine's metrics, relayed from its process
    assert metric_value(text, "flashtree_generation_tokens_total") >= 24 * len(PROMPTS)
    assert metric_value(text, "flashtree_requests_finished_total", 'finish_reason="length"') >= len(PROMPTS)
    assert 'flashtree_engine_info{device="cpu",dtype="torch.float32",method="none",model="tiny"} 1.0' in text


def test_choices_and_replicas_in_engine_processes(target):
    """n > 1 (the later choices wait for the first's prefill: ``after`` crosses the pipe as a key) and two
    data-parallel replicas, each in its own engine process: the tokens of one engine thread."""
    sampled = dict(model="tiny", messages=[{"role": "user", "content": "the cat sat"}], max_tokens=8, n=3,
                   temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    with ServerThread(server_config(target, **LIMITS)) as thread_server:
        choices = [c.message.content for c in client(thread_server).chat.completions.create(**sampled).choices]
        streams = concurrent_streams(thread_server, max_tokens=16)
    config = dataclasses.replace(server_config(target, **LIMITS), engine_process=True, data_parallel_size=2)
    with ServerThread(config) as replicas:
        assert [c.message.content for c in client(replicas).chat.completions.create(**sampled).choices] == choices
        assert concurrent_streams(replicas, max_tokens=16) == streams
        text = metrics_text(replicas)
    assert len(set(choices)) > 1
    for replica in ("0", "1"):  # (6 streams at once: the least loaded replica takes the next)
        assert metric_value(text, "flashtree_replica_generation_tokens_total", f'replica="{replica}"') > 0


def test_a_stream_that_leaves_frees_its_slot_and_others_finish(process_server):
    before = metric_value(metrics_text(process_server), "flashtree_requests_finished_total", 'finish_reason="abort"')
    chunks = client(process_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=2000, stream=True, **GREEDY)
    next(iter(chunks))
    chunks.close()  # the client leaves after its first chunk of 2,000 tokens
    aborted = wait_for_metric(process_server, "flashtree_requests_finished_total", 'finish_reason="abort"',
                              lambda v: v == before + 1)
    assert aborted == before + 1
    assert wait_for_metric(process_server, "flashtree_requests_running", "", lambda v: v == 0) == 0
    out = client(process_server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, **GREEDY)
    assert out.usage.completion_tokens == 5


def test_bad_structured_output_is_refused_on_the_http_side(process_server):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client(process_server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            extra_body={"guided_regex": "(unclosed"})
    out = client(process_server).chat.completions.create(  # (the tiny tokenizer's words decode space-joined)
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        extra_body={"guided_regex": "(cat|dog)+"})
    assert out.choices[0].finish_reason == "length"
    assert set(out.choices[0].message.content.split(" ")) <= {"cat", "dog"}


def test_a_crashed_engine_process_answers_503_and_stops_the_server(target):
    causes = []
    config = dataclasses.replace(server_config(target, **LIMITS), engine_process=True)
    with ServerThread(config, on_fatal=causes.append) as running:
        assert client(running).completions.create(model="tiny", prompt="one two", max_tokens=3,
                                                  **GREEDY).usage.completion_tokens == 3
        os.kill(running.app.state.flashtree.engine.runner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not causes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(causes) == 1 and "the engine process exited (killed by signal 9)" in causes[0]
        health = httpx.get(f"{running.url}/health", timeout=5)
        assert health.status_code == 503 and "engine process exited" in health.text
        with pytest.raises(openai.InternalServerError) as refused:
            client(running).completions.create(model="tiny", prompt="one two", max_tokens=3, **GREEDY)
        assert refused.value.status_code == 503


def test_a_server_stopped_while_its_engine_process_loads_ends_that_process(target):
    config = dataclasses.replace(server_config(target, **LIMITS), engine_process=True)
    with ServerThread(config, wait_ready=False) as loading:
        process = loading.app.state.flashtree.engine.runner._process
        assert httpx.get(f"{loading.url}/health", timeout=5).status_code == 503  # (still importing torch)
    process.join(1.0)  # (a load left to finish would take seconds, then see the stop)
    assert not process.is_alive() and process.exitcode == -signal.SIGKILL


def test_a_load_that_fails_in_the_engine_process_stops_serve(target, tmp_path):
    from flashtree.cli.serve import serve

    broken = save_tiny_chat_model(tmp_path / "broken")
    (broken / "model.safetensors").unlink()  # config.json is fine (the memory check passes), weights are gone
    with pytest.raises(FlashtreeError, match="safetensors"):
        serve(dataclasses.replace(server_config(broken), engine_process=True))


def test_a_kv_cache_too_big_is_refused_by_the_engine_process_with_the_memory_error(target):
    """With an engine process the server's own process never checks device memory (on CUDA that would make a
    context there); the engine process's check refuses the cache with the same message, and serve exits."""
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", str(target), "--device", "cpu",
               "--port", "0", "--engine-process", "--kv-pages", str(10**9), "--max-context", "128",
               "--threads", "1", "--log-level", "warning"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "the KV cache needs" in done.stderr and "--kv-pages" in done.stderr, done.stderr


def test_ctrl_c_stops_serve_and_its_engine_process(target):
    """Ctrl-C reaches the whole process group: the server stops, tells the engine process to stop, and
    exits as Ctrl-C ends a command (130), with no traceback and no process left behind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", str(target), "--device", "cpu",
               "--port", str(port), "--engine-process", "--max-running", "4", "--max-context", "128",
               "--threads", "1", "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(port):
            assert server.poll() is None, server.communicate()[1]
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.2)
        out = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0).completions.create(
            model=str(target), prompt="one two", max_tokens=3, **GREEDY)
        assert out.usage.completion_tokens == 3
        (engine,) = [int(c) for c in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
                     if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.killpg(server.pid, signal.SIGINT)
        _, stderr = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
    assert server.returncode == 130, stderr
    assert "Traceback" not in stderr and "engine stopped" not in stderr
    assert not Path(f"/proc/{engine}").exists() or "zombie" in Path(f"/proc/{engine}/status").read_text()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
