"""``flashtree serve``: the OpenAI-compatible server on uvicorn.

    flashtree serve --model smollm2 --spec none --port 8000
    flashtree serve --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --spec ddtree --budget 64 \\
        --api-key KEY --max-waiting 128

The KV-cache memory check runs before the port is bound; the model then loads and warms up
while ``/health`` answers 503; a load failure stops the server with exit status 2. A lost engine (a
tensor-parallel worker died) answers 503 to every request and stops the server with exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys

from flashtree.cli.args import HELP_FORMAT, add_model_args, engine_config_from_args
from flashtree.errors import AddressInUseError, FlashtreeError
from flashtree.server.config import EVENT_LOOPS, HTTP_IMPLEMENTATIONS, LOG_FORMAT, LOOPBACK, ServerConfig

API_KEY_ENV = "FLASHTREE_API_KEY"
PLAYGROUND_TREES = 4  # each request's last draft trees kept for the playground (GET /)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class EngineLostError(FlashtreeError):
    """The served engine stopped for good (a worker process died); the server stopped."""

    exit_code = 1


def register(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                                  formatter_class=HELP_FORMAT)
    add_model_args(serve)
    serve.add_argument("--host", default=LOOPBACK, help=f"address to bind (default {LOOPBACK}: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--responses-store-size", type=int, default=ServerConfig.responses_store_size,
                       help="responses /v1/responses keeps for previous_response_id and GET (the most recent; 0: none)")
    serve.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                       help="a request body larger than this is refused with 413 before it is read")
    serve.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch (default: torch's choice; 1 helps on a busy shared CPU)")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=ServerConfig.data_parallel_size, metavar="N",
                       help="N engine replicas behind one server (each on its own --tensor-parallel-size devices), "
                            "a conversation kept on the replica holding its prompt's prefix pages")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    serve.add_argument("--http", default="auto", choices=HTTP_IMPLEMENTATIONS,
                       help="uvicorn's HTTP protocol (default auto: httptools when installed, else h11)")
    serve.add_argument("--loop", default="auto", choices=EVENT_LOOPS,
                       help="uvicorn's event loop (default auto: uvloop when installed, else asyncio)")
    serve.add_argument("--switch-interval-ms", type=float, default=None,
                       help="the interpreter's thread switch interval while serving, in ms: the longest the HTTP "
                            "side keeps the interpreter lock from a waiting engine thread (default: Python's 5 ms)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in a process of its own (the HTTP side's Python then never "
                            "delays a step; commands and tokens cross a pipe), not on a thread of the server's "
                            "(default: a process on CUDA, a thread on CPU)")
    serve.set_defaults(func=cmd_serve, prefix_caching=True, recent_trees=PLAYGROUND_TREES)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    engine = engine_config_from_args(args)
    return ServerConfig(engine=engine, model_name=args.served_model_name or args.model, host=args.host,
                        port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        log_level=args.log_level, freeze_gc=True, http=args.http, loop=args.loop,
                        switch_interval_ms=args.switch_interval_ms, max_request_bytes=args.max_request_bytes,
                        responses_store_size=args.responses_store_size, data_parallel_size=args.data_parallel_size,
                        engine_process=args.engine_process)


def cmd_serve(args: argparse.Namespace) -> None:
    from flashtree.server.startup import check_kv_cache_fits

    config = config_from_args(args)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    if args.threads is not None:
        set_cpu_threads(args.threads)
    # refuse before loading anything; an engine process measures CUDA memory itself (no CUDA context here)
    check_kv_cache_fits(config.engine, measure_cuda=not config.runs_engine_process)
    check_address_free(config.host, config.port)
    serve(config)


def check_address_free(host: str, port: int) -> None:
    """Refuse a taken address before the model loads (a bind that fails later, with the engine thread
    loading, would leave that thread behind at exit)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise AddressInUseError(f"cannot listen on {host}:{port}: {err.strerror}; choose another --port "
                                    f"(or stop the process that holds it)") from None


def set_cpu_threads(threads: int) -> None:
    import torch

    if threads < 1:
        raise FlashtreeError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


@contextlib.contextmanager
def switch_interval(milliseconds: float | None):
    """The interpreter's thread switch interval set to ``milliseconds`` inside, restored after (None: unchanged)."""
    before = sys.getswitchinterval()
    if milliseconds is not None:
        sys.setswitchinterval(milliseconds / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def serve(config: ServerConfig) -> None:
    """Run until interrupted; raises the load error if the model cannot be loaded."""
    import uvicorn

    from flashtree.server.app import create_app

    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def stop_on_failure(err: BaseException) -> None:
        failures.append(err)
        if server is not None:
            server.should_exit = True

    def stop_on_lost_engine(cause: str) -> None:
        stop_on_failure(EngineLostError(f"{cause}; the server stopped"))

    app = create_app(config, on_load_failure=stop_on_failure, on_fatal=stop_on_lost_engine)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           http=config.http, loop=config.loop, timeout_graceful_shutdown=5))
    with switch_interval(config.switch_interval_ms):
        server.run()
    if failures:
        err = failures[0]
        raise err if isinstance(err, FlashtreeError) else FlashtreeError(f"the model failed to load: {err}")
