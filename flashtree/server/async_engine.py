"""AsyncEngine: the engine as the event loop sees it: submit a request, read its stream, cancel it.

Where the engine runs
- ``EngineThread`` (the default): an :class:`~flashtree.server.engine_driver.EngineDriver` on a
  background thread of the server's process. The event loop and the engine thread share one
  interpreter lock: at many streams the event loop's work per streamed token delays the steps.
- ``EngineProcess`` (``--engine-process``, ``server/engine_process.py``): the driver in a process
  of its own, so the HTTP side's Python never holds up a step; commands and deltas cross a pipe.

Threads and ownership
- The event loop owns each :class:`RequestStream`: it reads the stream's deltas from an
  ``asyncio.Queue`` that the driver's side fills through ``loop.call_soon_threadsafe``.
- The AsyncEngine is the driver's outbox on this side: a driver thread calls it directly, an engine
  process's pipe reader calls it with the streams its keys stand for.
- Cancelling a stream (client gone) sends an abort; the request's slot is free after the next step.

An engine that cannot go on (a tensor-parallel worker died, the engine process exited) is lost:
:meth:`AsyncEngine.fail` answers every request in flight and every new one with 503 naming the cause,
stops the driver, and calls ``on_fatal`` (the command line's server exits).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
import weakref
from collections import defaultdict
from typing import Callable, Protocol

from flashtree.engine.engine import LLMEngine
from flashtree.sampling import SamplingParams
from flashtree.server.engine_driver import Abort, EngineDriver, Inbox, Submit
from flashtree.server.generation import EngineInfo
from flashtree.server.metrics import ServerMetrics
from flashtree.server.stream import EngineUnavailable, GenerationDelta, RequestStream

log = logging.getLogger("flashtree.server")

LOST_PREFIX = "the engine stopped: "  # what a lost engine's messages start with (then the cause)
LOST_JOIN_S = 2.0  # how long stop() waits for a lost engine's driver (it may be blocked in a collective)

# ready(info, compile_structured): the engine loaded; compile_structured is the engine's own compiler
# when it shares this process, else None (the HTTP side then compiles with its own)
ReadyCallback = Callable[[EngineInfo, Callable | None], None]


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineRunner(Protocol):
    """Where the driver runs (:class:`EngineThread`, ``engine_process.EngineProcess``)."""

    engine: LLMEngine | None  # the engine object, when it lives in this process

    def start(self, front: "AsyncEngine") -> None: ...
    def send(self, command: Submit | Abort) -> None: ...
    def stop(self, reason: str, lost: bool) -> None: ...  # stop after the current step
    def join(self, timeout: float) -> None: ...
    def in_flight(self) -> int: ...  # requests sent and not finished


class EngineThread:
    """The driver on a daemon thread of this process, loading with ``load()``."""

    def __init__(self, load: Callable[[], LLMEngine]):
        self._load = load
        self.inbox = Inbox()
        self.driver: EngineDriver | None = None
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> LLMEngine | None:
        return self.driver.engine if self.driver is not None else None

    def start(self, front: "AsyncEngine") -> None:
        self.driver = EngineDriver(self._load, front.metrics, self.inbox, front, front.replica)
        self._thread = threading.Thread(target=self._run, args=(front,), name="flashtree-engine", daemon=True)
        self._thread.start()

    def _run(self, front: "AsyncEngine") -> None:
        self.driver.run()
        front.finished()

    def send(self, command: Submit | Abort) -> None:
        self.inbox.put(command)

    def stop(self, reason: str, lost: bool) -> None:
        self.inbox.stop(reason, lost)

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def in_flight(self) -> int:
        return len(self.inbox) + (self.driver.admitted if self.driver is not None else 0)


class AsyncEngine:
    """The event loop's engine (module docstring). ``runner``: an :class:`EngineThread` or an
    ``EngineProcess``; ``on_ready(info, compile_structured)`` once it loaded (any thread)."""

    def __init__(self, runner: EngineRunner, metrics: ServerMetrics, on_ready: ReadyCallback | None = None,
                 on_load_failure: Callable[[BaseException], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None, replica: int = 0):
        self.runner = runner
        self.metrics = metrics
        self.replica = replica  # its index among data-parallel replicas (metrics labels)
        self._on_ready = on_ready
        self._on_load_failure = on_load_failure
        self._on_fatal = on_fatal  # called once, from any thread, with the cause when the engine is lost
        self.state = EngineState.LOADING
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # why the engine stopped for good (see :meth:`fail`)
        self._live: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # streams submitted (guarded by _lock)
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def engine(self) -> LLMEngine | None:
        """The :class:`LLMEngine`, when it runs in this process (None in an engine process)."""
        return self.runner.engine

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self.runner.start(self)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the driver after the current step. A driver still loading is left behind (a daemon
        thread; an engine process is ended), and so is a lost engine's that stays blocked past ``LOST_JOIN_S``."""
        self._stopping = True
        self.runner.stop(self.fatal_error or "the server is shutting down", self.fatal_error is not None)
        if self.state is not EngineState.LOADING:
            self.runner.join(LOST_JOIN_S if self.fatal_error is not None else timeout)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def load(self) -> int:
        """Requests submitted and not finished: queued for the driver or admitted (any thread)."""
        return self.runner.in_flight()

    async def submit(self, prompt_ids: list[int], params: SamplingParams, budget: int | None = None,
                     arrival: float | None = None, after: RequestStream | None = None,
                     speculation: bool = False) -> RequestStream:
        """Queue a request; returns its stream once the engine admitted it, or raises the
        engine's refusal (``RequestError``, ``QueueFullError``). ``after``: the stream of a request
        with the same prompt (n > 1) whose prefill this one waits for (``LLMEngine.add_request``);
        ``speculation``: its deltas carry its rounds and draft trees."""
        if self.fatal_error is not None:
            raise EngineUnavailable(self.fatal_error)
        if self.state is not EngineState.READY or self._stopping:
            raise EngineUnavailable(f"the engine is {'stopping' if self._stopping else self.state.value}")
        stream = RequestStream(asyncio.get_running_loop())
        with self._lock:
            self._live.add(stream)
        self._send(Submit(stream, list(prompt_ids), params, budget, arrival or time.monotonic(), after, speculation))
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self.cancel(stream)
            raise
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Abort the stream's request unless it already finished (frees its slot)."""
        if not stream.finished:
            stream.finished = True
            self._send(Abort(stream))

    def _send(self, command: Submit | Abort) -> None:
        self.runner.send(command)

    def fail(self, cause: str) -> None:
        """The engine is lost (any thread; once): every request submitted and not finished, and every
        new one, is answered with 503 naming ``cause``; the driver stops; ``on_fatal(cause)``."""
        message = LOST_PREFIX + cause
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error, self.state, self._stopping = message, EngineState.FAILED, True
            streams = list(self._live)
        self.runner.stop(message, lost=True)
        log.error("%s; answering every request with 503", message)
        for stream in streams:  # (the driver may be blocked: the deltas go from here)
            _post(stream.loop, _settle, stream.admitted, EngineUnavailable(message))
            _post(stream.loop, _deliver, [(stream, GenerationDelta((), "", None, error=message, lost=True))])
        if self._on_fatal is not None:
            self._on_fatal(message)

    # ------------------------------------------------------------------ the driver's outbox
    def loaded(self, engine: LLMEngine) -> None:
        """The engine loaded in this process (a driver thread)."""
        self.ready_with(EngineInfo.of(engine), engine.compile_structured)

    def ready_with(self, info: EngineInfo, compile_structured: Callable | None) -> None:
        if self._on_ready is not None:
            self._on_ready(info, compile_structured)
        self.state = EngineState.READY

    def load_failed(self, error: BaseException) -> None:
        self.load_error = f"{type(error).__name__}: {error}"
        self.state = EngineState.FAILED
        if self._on_load_failure is not None:
            self._on_load_failure(error)

    def settle(self, stream: RequestStream, error: BaseException | None) -> None:
        """The driver admitted the stream's request (``error`` None) or refused it."""
        _post(stream.loop, _settle, stream.admitted, error)

    def deliver(self, batch: list[tuple[RequestStream, GenerationDelta]]) -> None:
        """One step's deltas, handed to each stream's event loop in one callback per loop."""
        by_loop = defaultdict(list)
        for stream, delta in batch:
            by_loop[stream.loop].append((stream, delta))
        for loop, deliveries in by_loop.items():
            _post(loop, _deliver, deliveries)

    def lost(self, cause: str) -> None:
        self.fail(cause)

    def flush(self) -> None:
        """(Nothing is buffered on this side.)"""

    def finished(self) -> None:
        """The driver has stopped."""
        if self.fatal_error is None and self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` (from another thread); a closed loop drops it."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[RequestStream, GenerationDelta]]) -> None:
    for stream, delta in batch:
        stream.deltas.put_nowait(delta)
