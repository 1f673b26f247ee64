"""ServerConfig: what ``flashtree serve`` was asked for, validated once, frozen."""

from __future__ import annotations

import dataclasses

from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.models.build import resolve_device

LOOPBACK = "127.0.0.1"
HTTP_IMPLEMENTATIONS = ("auto", "h11", "httptools")  # uvicorn's HTTP/1.1 protocols (auto: httptools if installed)
EVENT_LOOPS = ("auto", "asyncio", "uvloop")  # uvicorn's event loops (auto: uvloop if installed)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's log lines (and its engine process's)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    model_name: str  # the name clients pass as "model" (default: --model)
    host: str = LOOPBACK  # loopback unless asked: the API has no rate limits of its own
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    log_level: str = "info"
    freeze_gc: bool = False  # after loading, exempt startup objects from garbage collection (the CLI's own process)
    http: str = "auto"  # uvicorn's HTTP protocol: streamed tokens are parsed and framed in C with httptools
    loop: str = "auto"  # uvicorn's event loop
    # the interpreter's thread switch interval while serving (sys.setswitchinterval), in ms: how long
    # the event loop may keep the interpreter lock from the engine thread that waits for it (None: Python's 5 ms)
    switch_interval_ms: float | None = None
    max_request_bytes: int = 8 * 1024 * 1024  # a larger request body is refused (413) before it is read
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id and GET (most recent first)
    data_parallel_size: int = 1  # engine replicas behind the server's router (server/replicas.py)
    # each engine in a process of its own (True) or on a thread of the server's (False); None: a process for a
    # CUDA engine, a thread for a CPU one (see runs_engine_process)
    engine_process: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port!r}")
        if not self.model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.http not in HTTP_IMPLEMENTATIONS:
            raise ConfigError(f"--http must be one of {', '.join(HTTP_IMPLEMENTATIONS)}, got {self.http!r}")
        if self.loop not in EVENT_LOOPS:
            raise ConfigError(f"--loop must be one of {', '.join(EVENT_LOOPS)}, got {self.loop!r}")
        if self.switch_interval_ms is not None and (isinstance(self.switch_interval_ms, bool) or not (
                isinstance(self.switch_interval_ms, (int, float))
                and 0 < self.switch_interval_ms <= 1000)):
            raise ConfigError(f"--switch-interval-ms must be in (0, 1000], got {self.switch_interval_ms!r}")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if isinstance(self.responses_store_size, bool) or not isinstance(self.responses_store_size, int) \
                or self.responses_store_size < 0:
            raise ConfigError(f"--responses-store-size must be an integer >= 0, got {self.responses_store_size!r}")
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int) \
                or self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ConfigError(f"engine_process must be true, false or unset (auto), got {self.engine_process!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")

    @property
    def runs_engine_process(self) -> bool:
        """Whether each engine runs in a process of its own: ``engine_process``, or, unset, whether the engine
        runs on CUDA. A CUDA step leaves the host waiting on the device, and in a process of its own the
        HTTP side's Python (requests, SSE events) runs beside it instead of taking turns with it
        under one interpreter lock: 1.34x / 1.09x the tokens/s of an engine thread at 16 / 64 streams
        (H100, benchmarks/journal/session-41-2026-12-07.md). A CPU engine needs the cores the HTTP side
        uses, so it stays on a thread there (0.94x as a process at 64 streams on 2 cores)."""
        if self.engine_process is not None:
            return self.engine_process
        return resolve_device(self.engine.target.device).type == "cuda"
