"""Support for the server tests: a tiny word-level tokenizer with a chat template for the tiny
random models, tiny model directories that carry it, and a real uvicorn server running a
flashtree app on a free port of 127.0.0.1 in a background thread.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from flashtree.config import EngineConfig, SpeculationConfig
from flashtree.server.app import create_app
from flashtree.server.config import ServerConfig
from tests.helpers import tiny_hf_model

SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: unk, bos, eos = end of turn
BASE_WORDS = ("system", "user", "assistant", "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to",
              "big", "small", "red", "blue", "sky", "sea", "sun", "moon", "tree", "house", "is", "was", "very",
              "hello", "world", "what", "how", "why", "who", "where", "when", "one", "two", "three", "four",
              "five", "six", "seven", "eight", "nine", "ten", ".", ",", "?", "!")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 97):
    """A WordLevel tokenizer with exactly ``vocab_size`` tokens: decoding joins words with spaces,
    so the text of a token prefix is a prefix of the text of the whole (clean stream deltas)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fillers = [f"w{i}" for i in range(vocab_size)]
    tokens = (list(SPECIAL_TOKENS) + list(BASE_WORDS) + fillers)[:vocab_size]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                        eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_tokenizer(model_dir: Path) -> None:
    """Add the tiny tokenizer (sized from config.json's vocab_size) to a model directory."""
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tiny_tokenizer(vocab_size).save_pretrained(model_dir)


def save_tiny_chat_model(path: Path, family: str = "llama_gqa", vocab_size: int = 97) -> Path:
    tiny_hf_model(family, vocab_size=vocab_size).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def server_config(model: Path | str, *, method: str = "none", draft: str | None = None, api_key: str | None = None,
                  budget: int | None = None, **engine) -> ServerConfig:
    engine.setdefault("device", "cpu")
    spec = SpeculationConfig(method=method, draft=draft, budget=budget)
    return ServerConfig(engine=EngineConfig.of(model=str(model), spec=spec, **engine), model_name="tiny",
                        port=0, api_key=api_key, log_level="warning")


class ServerThread:
    """A uvicorn server in a daemon thread: ``with ServerThread(config) as server: server.url``."""

    def __init__(self, config: ServerConfig, wait_ready: bool = True, **app_options):
        self.config = config
        self.app = create_app(config, **app_options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    http=config.http, loop=config.loop, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.wait_ready = wait_ready
        self.url = ""

    @property
    def method(self) -> str:
        return self.config.engine.speculation.method

    @property
    def vocab_size(self) -> int:
        return self.app.state.flashtree.served.vocab_size

    def tokenizer(self):
        """A fresh copy of the served tokenizer (the server's own are used by its threads)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.engine.target.model)

    @property
    def engine(self):
        """The engine (tests poke it from this thread only while it is idle or via flags); None when it
        runs in an engine process."""
        return self.app.state.flashtree.engine.engine

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if self.wait_ready:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (health := httpx.get(f"{self.url}/health", timeout=5)).status_code != 200:
            if time.monotonic() > deadline or "failed to load" in health.text:
                raise RuntimeError(f"the server never became healthy: {health.text}")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric_value(metrics_text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` like ``finish_reason="abort"``)."""
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or (labels and key == f"{name}{{{labels}}}"):
            return float(value)
    return 0.0


# ---------------------------------------------------------------------------- holding the engine
# Tests of what happens while a request is still running (a client that leaves, times out, or
# finds the queue full) hold the engine's rounds on an event instead of counting on a long
# request taking longer than the client: the outcome does not depend on how fast the engine runs.

def hold_rounds(engine, monkeypatch, release: threading.Event, when=lambda rows: True, timeout: float = 60.0) -> None:
    """The engine's rounds wait for ``release`` (at most ``timeout`` seconds, so a broken test ends)
    whenever ``when(rows)`` holds for the round's requests."""
    real_launch = engine.runner.launch

    def launch(rows, *args, **kwargs):
        if when(rows):
            release.wait(timeout)
        return real_launch(rows, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", launch)


def after_cancel(server: ServerThread, monkeypatch, callback) -> None:
    """Call ``callback`` once the server has sent the engine thread the abort of a request whose
    client left (the engine thread applies it before its next step)."""
    async_engine = server.app.state.flashtree.engine
    real_cancel = async_engine.cancel

    def cancel(stream):
        real_cancel(stream)
        callback()

    monkeypatch.setattr(async_engine, "cancel", cancel)


def after_submissions(server: ServerThread, monkeypatch, count: int, callback) -> None:
    """Call ``callback`` once ``count`` requests have been sent to the engine thread (from now on)."""
    from flashtree.server.engine_driver import Submit

    async_engine = server.app.state.flashtree.engine
    real_send = async_engine._send
    sent = []

    def send(command):
        real_send(command)
        if isinstance(command, Submit):
            sent.append(command)
            if len(sent) == count:
                callback()

    monkeypatch.setattr(async_engine, "_send", send)
