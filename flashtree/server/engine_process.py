"""EngineProcess: the engine's driver in a process of its own (``flashtree serve --engine-process``).

Why: in one process the event loop (HTTP, one SSE event per streamed token) and the engine thread
share the interpreter lock, so at many streams the HTTP side's Python delays the engine's steps. In
its own process the driver steps at the engine's pace, and the server process only streams.

How (vLLM's engine-core process is the same idea):
- The process starts with ``spawn`` (CUDA needs a fresh interpreter), builds the engine from the
  :class:`EngineConfig`, and runs an :class:`EngineDriver` whose handles are integer keys.
- Two one-way pipes. Server -> engine: ``("submit", Submit)``, ``("abort", key)``, ``("stop", reason,
  lost)``; a receiver thread in the engine process moves them into the driver's inbox, so the server
  never waits for a step to hand over a command. Engine -> server: one list of messages per driver
  iteration (admissions, one step's deltas, metric updates in order), read by a thread of the server
  process that calls the :class:`AsyncEngine` (the driver's outbox on that side) with the streams
  the keys stand for.
- Metrics: the driver's metric calls are recorded (:class:`MetricsRelay`) and replayed on the
  server's :class:`ServerMetrics`, so ``/metrics`` reads as with an engine thread.
- The engine process ends when told to stop, when its command pipe closes (the server exited), or
  by itself (a crash); the server's reader sees the pipe close and, unless the server was stopping,
  the engine is lost (503 for every request, the server exits), as when a tensor-parallel worker dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import threading
from typing import Any

import torch

from flashtree.config import EngineConfig
from flashtree.engine.engine import LLMEngine
from flashtree.errors import FlashtreeError
from flashtree.server.async_engine import AsyncEngine, EngineState
from flashtree.server.config import LOG_FORMAT
from flashtree.server.engine_driver import SHUTTING_DOWN, Abort, EngineDriver, Inbox, Submit
from flashtree.server.generation import EngineInfo
from flashtree.server.startup import load_for_serving
from flashtree.server.stream import RequestStream

log = logging.getLogger("flashtree.server")

STOP_WAIT_S = 5.0  # how long a stopping server waits for the engine process before ending it
# the ServerMetrics methods the driver calls (what the relay records and the server replays)
RELAYED_METRICS = frozenset({"count_admitted", "count_finished", "observe_step", "set_load", "set_prefix_cache",
                             "set_graphs"})


class EngineProcess:
    """Runs the driver in a spawned process (module docstring); an :class:`AsyncEngine`'s runner."""

    engine = None  # (the LLMEngine lives in the other process)

    def __init__(self, config: EngineConfig, freeze_gc: bool = False, log_level: str = "info", replica: int = 0):
        self.config, self.freeze_gc, self.log_level, self.replica = config, freeze_gc, log_level, replica
        self._streams: dict[int, RequestStream] = {}  # key -> stream, until its last delta
        self._send_lock = threading.Lock()
        self._stopping = False
        self._loaded = False  # its "ready" (or "load_failed") came
        self._process = None
        self._commands = self._events = None

    def start(self, front: AsyncEngine) -> None:
        context = multiprocessing.get_context("spawn")
        commands_out, self._commands = context.Pipe(duplex=False)
        self._events, events_in = context.Pipe(duplex=False)
        self._process = context.Process(target=serve_engine, name=f"flashtree-engine-{self.replica}",
                                        args=(self.config, self.freeze_gc, self.log_level, self.replica,
                                              torch.get_num_threads(), commands_out, events_in))
        self._process.start()  # (not a daemon: a tensor-parallel engine starts processes of its own)
        commands_out.close()
        events_in.close()
        threading.Thread(target=self._read, args=(front,), name=f"flashtree-engine-reader-{self.replica}",
                         daemon=True).start()

    def send(self, command: Submit | Abort) -> None:
        if isinstance(command, Submit):
            self._streams[command.handle.key] = command.handle
            after = None if command.after is None else command.after.key
            message = ("submit", Submit(command.handle.key, command.prompt_ids, command.params, command.budget,
                                        command.arrival, after, command.speculation))
        else:  # (the stream is done: a delta still on its way is dropped)
            message = ("abort", command.handle.key)
            self._streams.pop(command.handle.key, None)
        self._put(message)

    def stop(self, reason: str, lost: bool) -> None:
        """Stop after the current step; an engine process still loading is ended now (the server's
        process must not wait at exit for a load nobody will use)."""
        self._stopping = True
        self._put(("stop", reason, lost))
        if not self._loaded and self._process is not None and self._process.is_alive():
            self._process.kill()

    def join(self, timeout: float) -> None:
        if self._process is None:
            return
        self._process.join(min(timeout, STOP_WAIT_S))
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; ending it", min(timeout, STOP_WAIT_S))
            self._process.kill()
            self._process.join(STOP_WAIT_S)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def in_flight(self) -> int:
        return len(self._streams)

    def _put(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._commands.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader reports it
                pass

    # ------------------------------------------------------------------ the reader thread
    def _read(self, front: AsyncEngine) -> None:
        while True:
            try:
                messages = self._events.recv()
            except (EOFError, OSError):
                break
            for message in messages:
                try:
                    self._dispatch(front, *message)
                except Exception:  # noqa: BLE001 - one bad message must not stop every stream's deliveries
                    log.exception("the engine process's message %r could not be applied", message[0])
        if self._stopping or front.state is EngineState.FAILED:  # (stopped, lost, or it failed to load)
            return
        self._process.join(1.0)
        if front.state is EngineState.LOADING:
            front.load_failed(FlashtreeError(f"the engine process exited while loading ({_exit(self._process)})"))
        else:
            front.fail(f"the engine process exited ({_exit(self._process)})")

    def _dispatch(self, front: AsyncEngine, kind: str, *args) -> None:
        if kind == "deliver":
            batch = []
            for key, delta in args[0]:
                stream = self._streams.pop(key, None) if delta.finished else self._streams.get(key)
                if stream is not None:  # (None: cancelled meanwhile)
                    batch.append((stream, delta))
            front.deliver(batch)
        elif kind == "metric":
            name, positional, named = args
            getattr(front.metrics, name)(*positional, **named)
        elif kind == "settle":
            key, error = args
            stream = self._streams.get(key) if error is None else self._streams.pop(key, None)
            if stream is not None:
                front.settle(stream, error)
        elif kind == "ready":
            self._loaded = True
            front.ready_with(args[0], None)
        elif kind == "load_failed":
            self._loaded = True
            front.load_failed(args[0])
        elif kind == "lost":
            front.fail(args[0])


def _exit(process) -> str:
    code = process.exitcode
    return "still running" if code is None else f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


# ---------------------------------------------------------------------------- in the engine process
def serve_engine(config: EngineConfig, freeze_gc: bool, log_level: str, replica: int, cpu_threads: int,
                 commands, events) -> None:
    """The engine process's main: receive commands, run the driver, report through ``events``. Ctrl-C
    reaches the whole process group: the server stops this process through the pipe, so it ignores SIGINT.
    ``cpu_threads``: torch's CPU threads in the server process (``serve --threads``), kept here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(cpu_threads)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    inbox, outbox = Inbox(), PipeOutbox(events)
    threading.Thread(target=_receive, args=(commands, inbox), name="flashtree-commands", daemon=True).start()
    EngineDriver(lambda: load_for_serving(config, freeze_gc), outbox.metrics, inbox, outbox, replica).run()
    events.close()


def _receive(commands, inbox: Inbox) -> None:
    """Move the server's commands into the inbox; a closed pipe (the server exited) stops the driver."""
    while True:
        try:
            kind, *args = commands.recv()
        except (EOFError, OSError):
            inbox.stop(SHUTTING_DOWN)
            return
        if kind == "submit":
            inbox.put(args[0])
        elif kind == "abort":
            inbox.put(Abort(args[0]))
        else:
            inbox.stop(*args)


class MetricsRelay:
    """Records the driver's metric calls (the :class:`ServerMetrics` methods in ``RELAYED_METRICS``)
    as messages for the server process to replay."""

    def __init__(self, outbox: "PipeOutbox"):
        self._outbox = outbox

    def __getattr__(self, name: str):
        if name not in RELAYED_METRICS:
            raise AttributeError(f"ServerMetrics.{name} is not relayed from an engine process")
        return lambda *positional, **named: self._outbox.add(("metric", name, positional, named))


class PipeOutbox:
    """The driver's outbox in the engine process: messages buffered and sent once per driver iteration
    (``flush``); loading, failures and a lost engine are sent at once."""

    def __init__(self, events):
        self._events = events
        self._buffer: list[tuple] = []
        self._lock = threading.Lock()  # (a lost engine is reported from the workers' watcher thread)
        self.metrics = MetricsRelay(self)

    def add(self, message: tuple) -> None:
        with self._lock:
            self._buffer.append(message)

    def flush(self) -> None:
        with self._lock:
            messages, self._buffer = self._buffer, []
            if messages:
                try:
                    self._events.send(messages)
                except (OSError, ValueError):
                    pass  # the server is gone

    def loaded(self, engine: LLMEngine) -> None:
        self.add(("ready", EngineInfo.of(engine)))
        self.flush()

    def load_failed(self, error: BaseException) -> None:
        self.add(("load_failed", _portable(error)))
        self.flush()

    def settle(self, handle: int, error: BaseException | None) -> None:
        self.add(("settle", handle, None if error is None else _portable(error)))

    def deliver(self, batch: list[tuple[int, Any]]) -> None:
        self.add(("deliver", batch))

    def lost(self, cause: str) -> None:
        self.add(("lost", cause))
        self.flush()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a FlashtreeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return FlashtreeError(f"{type(error).__name__}: {error}")
