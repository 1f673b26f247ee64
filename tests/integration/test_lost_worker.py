"""A tensor-parallel worker that dies under a server or ``generate`` (2 gloo ranks on the CPU): the real
uvicorn server and the official ``openai`` client.

- Requests in flight (one admitted and held inside a round, others not yet admitted) are answered
  with 503 naming the dead rank within seconds, while the engine thread is still blocked: the
  executor's watcher reports the death, not the next collective. New requests and ``/health`` get
  503 with the same cause; the server's ``on_fatal`` runs once; the engine thread ends once released.
- ``flashtree serve`` whose worker is killed while idle exits with status 1 within seconds, its
  message naming the rank; ``flashtree generate`` exits with status 1 and the message.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server import (
    ServerThread,
    after_submissions,
    hold_rounds,
    save_tiny_chat_model,
    server_config,
)

SETTINGS = {"max_running": 4, "max_context": 128, "prefill_chunk": 8, "max_waiting": 16, "tensor_parallel_size": 2,
            "worker_timeout_s": 60.0}
CHAT = [{"role": "user", "content": "hello world , how is the cat ?"}]
cli_main = importlib.import_module("flashtree.cli.main")  # (the package's ``main`` attribute is the function)
ANSWER_WITHIN_S = 10.0  # from the kill to every in-flight answer (the engine thread stays blocked meanwhile)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("lost") / "target")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(url: str, stream: bool) -> str:
    """The answer's text (a stream read to its end)."""
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if not stream:
        return client(url).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(url).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def assert_names_the_dead_rank(err: BaseException) -> None:
    assert isinstance(err, openai.APIError), repr(err)
    if isinstance(err, openai.APIStatusError):  # (a stream already answered 200 carries it as an error event)
        assert err.status_code == 503
    assert "rank 1" in str(err) and "exited with status" in str(err), str(err)


def test_in_flight_and_new_requests_get_503_naming_the_dead_rank(target, monkeypatch):
    causes: list[str] = []
    with ServerThread(server_config(target, **SETTINGS), on_fatal=causes.append) as server:
        chat(server.url, stream=False)  # (it serves before the kill)
        async_engine = server.app.state.flashtree.engine
        release, holding, sent = threading.Event(), threading.Event(), threading.Event()
        hold_rounds(server.engine, monkeypatch, release, when=lambda rows: holding.set() or True)
        after_submissions(server, monkeypatch, 3, sent.set)
        pool = concurrent.futures.ThreadPoolExecutor(3)
        try:
            futures = [pool.submit(chat, server.url, stream) for stream in (False, True, False)]
            assert holding.wait(60) and sent.wait(60)  # one admitted and held in a round, the rest sent
            os.kill(server.engine.executor.workers[0].process.pid, signal.SIGKILL)
            killed = time.monotonic()
            for future in futures:
                with pytest.raises(openai.APIError) as caught:
                    future.result(timeout=ANSWER_WITHIN_S)
                assert_names_the_dead_rank(caught.value)
            assert time.monotonic() - killed < ANSWER_WITHIN_S
            assert async_engine.runner._thread.is_alive()  # (answered while the engine thread is still blocked)

            with pytest.raises(openai.APIStatusError) as caught:  # a new request
                chat(server.url, stream=False)
            assert_names_the_dead_rank(caught.value)
            health = httpx.get(f"{server.url}/health", timeout=5)
            assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
            assert len(causes) == 1 and "rank 1" in causes[0]
        finally:
            release.set()
            pool.shutdown(wait=True)
        async_engine.runner._thread.join(30)
        assert not async_engine.runner._thread.is_alive()  # released: the round fails on the dead rank, the thread ends
        assert len(causes) == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawned_workers(pid: int) -> list[int]:
    """The multiprocessing workers (spawn) among the children of process ``pid`` (not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("where", ["thread", "process"])
def test_serve_exits_with_the_cause_when_a_worker_dies(target, where):
    """Rank 0 on the server's engine thread, or in an engine process (the CUDA default) whose own children
    the workers are."""
    port = free_port()
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", str(target), "--device", "cpu",
               "--port", str(port), "--spec", "none", "-tp", "2", "--max-running", "4", "--max-context", "128",
               "--threads", "1", "--log-level", "warning", "--served-model-name", "tiny",
               f"--{'' if where == 'process' else 'no-'}engine-process"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.2)
        assert chat(f"http://127.0.0.1:{port}", stream=True)  # (it serves before the kill)
        rank0 = server.pid if where == "thread" else spawned_workers(server.pid)[0]
        (worker,) = spawned_workers(rank0)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = server.communicate(timeout=30)
        assert time.monotonic() - killed < 15
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 1
    assert "flashtree: error: the engine stopped: tensor-parallel worker rank 1" in stderr
    assert "exited with status -9" in stderr and "the server stopped" in stderr


def test_generate_exits_with_the_cause_when_a_worker_dies(target, monkeypatch, capsys):
    from flashtree.cli.args import llm_from_args

    def llm_whose_worker_dies(args, **overrides):
        llm = llm_from_args(args, **overrides)
        worker = llm.engine.executor.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        return llm

    monkeypatch.setattr(cli_main, "llm_from_args", llm_whose_worker_dies)
    status = cli_main.main(["generate", "--model", str(target), "--device", "cpu", "--spec", "none", "-tp", "2",
                           "--prompt", "hello", "--max-tokens", "4"])
    assert status == 1
    message = capsys.readouterr().err
    assert message.startswith("flashtree: error: tensor-parallel worker rank 1") and "exited with status -9" in message
