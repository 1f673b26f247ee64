"""AsyncEngine: the single-threaded :class:`LLMEngine` on one background thread, used from asyncio.

Threads and ownership
- The engine thread owns the engine: it loads it, applies commands (submit, abort) between
  steps, runs ``step()`` while there is work, and sleeps on a condition when idle (no spin).
- The event loop owns each :class:`RequestStream`: it reads the stream's deltas from an
  ``asyncio.Queue`` that the engine thread fills through ``loop.call_soon_threadsafe``.
- Commands travel in one deque guarded by ``_wakeup`` (the thread-safe queue); nothing else
  is shared. Cancelling a stream (client gone) sends an abort command; the engine thread
  aborts the request and its slot is free after the next step.

An exception from ``step()`` fails the requests that were in the batch (their streams get an
error delta, the server answers 500) and the thread keeps serving the others. An engine that cannot
go on (a tensor-parallel worker died: ``step()`` raised TensorParallelError, or the executor's watcher
saw the process exit while the engine was idle or blocked) is lost: :meth:`AsyncEngine.fail` answers
every request in flight and every new one with 503 naming the cause, stops the thread, and calls
``on_fatal`` (the command line's server exits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from typing import AsyncIterator, Callable

from flashtree.engine.engine import LLMEngine
from flashtree.engine.output import StepEvent
from flashtree.engine.request import Request
from flashtree.engine.tp_executor import TensorParallelError
from flashtree.sampling import SamplingParams
from flashtree.server.logprobs import LogprobText, TokenTexts
from flashtree.server.metrics import ServerMetrics

log = logging.getLogger("flashtree.server")

LOST_PREFIX = "the engine stopped: "  # what a lost engine's messages start with (then the cause)
LOST_JOIN_S = 2.0  # how long stop() waits for a lost engine's thread (it may be blocked in a collective)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineFailure(Exception):
    """The engine failed while running this request (HTTP 500)."""

    status, code = 500, None


class EngineLost(EngineFailure):
    """The engine stopped for good while this request ran (a worker process died): HTTP 503."""

    status, code = 503, "engine_unavailable"


class EngineUnavailable(Exception):
    """The engine is not serving (loading, failed, or shutting down): HTTP 503."""


@dataclasses.dataclass(frozen=True)
class RequestUsage:
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    mean_acceptance_length: float
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def of(cls, req: Request) -> "RequestUsage":
        return cls(len(req.prompt_ids), len(req.output_ids), req.stats.rounds, req.stats.mean_acceptance_length,
                   req.cached_tokens)


@dataclasses.dataclass(frozen=True)
class GenerationDelta:
    """What one engine step added to one request."""

    token_ids: tuple[int, ...]
    text: str
    usage: RequestUsage | None  # on the last delta (and an error's) only: nothing reads it before
    finish_reason: str | None = None  # set on the last delta: stop | length | abort
    full_text: str | None = None  # the whole output text, on the last delta
    error: str | None = None  # the engine failed this request
    logprobs: tuple[LogprobText, ...] | None = None  # one per token, when the request asked
    stopped_by: str | int | None = None  # on the last delta: the stop string or token id that ended it
    # the speculation behind it, when the request asked: {"rounds": acceptance lengths of its rounds,
    # "tree": the newest draft tree with its tokens' texts (absent when no new one)}
    speculation: dict | None = None
    lost: bool = False  # with ``error``: the engine stopped for good (503), not a failure of this request (500)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """One request's deltas, read on the event loop with ``async for``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.admitted: asyncio.Future[None] = loop.create_future()  # raises the engine's refusal
        self.deltas: asyncio.Queue[GenerationDelta] = asyncio.Queue()
        self.finished = False  # the last delta was read (event-loop side)
        self.request_id: str | None = None  # set by the engine thread at admission
        self.replica = 0  # the data-parallel replica serving it (server/replicas.py)

    async def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        async for batch in self.batches():
            for delta in batch:
                yield delta

    async def batches(self) -> AsyncIterator[list[GenerationDelta]]:
        """The deltas in batches: each waits for one, then takes every delta already queued behind
        it (several when the reader fell behind the engine: a stream then sends them in one write)."""
        while not self.finished:
            batch = [await self.deltas.get()]
            while not batch[-1].finished and not self.deltas.empty():
                batch.append(self.deltas.get_nowait())
            self.finished = batch[-1].finished  # (an error delta is a last one)
            if batch[-1].error is not None:
                if len(batch) > 1:
                    yield batch[:-1]
                raise (EngineLost if batch[-1].lost else EngineFailure)(batch[-1].error)
            yield batch


@dataclasses.dataclass(frozen=True)
class _Submit:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    budget: int | None
    arrival: float  # time.monotonic() when the HTTP request arrived
    after: RequestStream | None = None  # a request with the same prompt to wait for (n > 1)
    speculation: bool = False  # its deltas carry its rounds and draft trees


@dataclasses.dataclass(frozen=True)
class _Abort:
    stream: RequestStream


@dataclasses.dataclass
class _Tracked:
    """Engine-thread bookkeeping of one admitted request."""

    request: Request
    stream: RequestStream
    arrival: float
    last_token_at: float | None = None
    rounds_seen: int = 0
    speculation: bool = False  # its deltas carry its rounds and draft trees (GenerationDelta.speculation)
    rounds_shown: int = 0
    tree_shown: int = -1  # the round of the last tree sent


class AsyncEngine:
    def __init__(self, load: Callable[[], LLMEngine], metrics: ServerMetrics,
                 on_load_failure: Callable[[BaseException], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None, replica: int = 0):
        self._load = load
        self.metrics = metrics
        self.replica = replica  # its index among data-parallel replicas (metrics labels)
        self._on_load_failure = on_load_failure
        self._on_fatal = on_fatal  # called once, from any thread, with the cause when the engine is lost
        self.state = EngineState.LOADING
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # why the engine stopped for good (see :meth:`fail`)
        self._live: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # streams submitted (guarded by _wakeup)
        self.engine: LLMEngine | None = None
        self.loaded = threading.Event()  # set once the state leaves LOADING
        self._commands: deque[_Submit | _Abort] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}
        self._token_texts: TokenTexts | None = None  # (engine thread) for log-probabilities
        self._thread = threading.Thread(target=self._run, name="flashtree-engine", daemon=True)

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step. A thread still loading is left behind (daemon), and so
        is a lost engine's thread that stays blocked past ``LOST_JOIN_S``."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive() and self.state is not EngineState.LOADING:
            self._thread.join(LOST_JOIN_S if self.fatal_error is not None else timeout)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def load(self) -> int:
        """Requests submitted and not finished: queued for the engine thread or admitted (any thread)."""
        return len(self._commands) + len(self._tracked)

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
        with self._wakeup:
            self._live.add(stream)
        self._send(_Submit(stream, list(prompt_ids), params, budget, arrival or time.monotonic(), after, speculation))
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
            self._send(_Abort(stream))

    def _send(self, command: _Submit | _Abort) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def fail(self, cause: str) -> None:
        """The engine is lost (any thread; once): every request submitted and not finished, and every
        new one, is answered with 503 naming ``cause``; the engine thread stops; ``on_fatal(cause)``."""
        message = LOST_PREFIX + cause
        with self._wakeup:
            if self.fatal_error is not None:
                return
            self.fatal_error, self.state, self._stopping = message, EngineState.FAILED, True
            streams = list(self._live)
            self._commands.clear()
            self._wakeup.notify()
        log.error("%s; answering every request with 503", message)
        for stream in streams:  # (the engine thread may be blocked: the deltas go from here)
            _post(stream.loop, _settle, stream.admitted, EngineUnavailable(message))
            _post(stream.loop, _deliver, [(stream, GenerationDelta((), "", None, error=message, lost=True))])
        if self._on_fatal is not None:
            self._on_fatal(message)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if not self._load_engine():
            return
        while (commands := self._wait_for_work()) is not None:
            try:
                self._iterate(commands)
            except TensorParallelError as err:
                self.fail(str(err))
            except Exception as err:  # noqa: BLE001 - a bug here must not stop the thread
                self._fail_active(_incident("engine loop failed; failing the requests in the batch", err))
        self._fail_all(self.fatal_error or "the server is shutting down")
        self.engine.close_traces()
        self.engine.close()
        if self.fatal_error is None:
            self.state = EngineState.STOPPED

    def _load_engine(self) -> bool:
        try:
            self.engine = self._load()
        except BaseException as err:  # noqa: BLE001 - reported to the CLI, which exits
            log.error("loading the engine failed: %s", err)
            self.load_error = f"{type(err).__name__}: {err}"
            self.state = EngineState.FAILED
            self.loaded.set()
            if self._on_load_failure is not None:
                self._on_load_failure(err)
            return False
        self._token_texts = TokenTexts(self.engine.tokenizer)
        self.state = EngineState.READY
        self.loaded.set()
        self.engine.watch_workers(self.fail)
        return True

    def _wait_for_work(self) -> list[_Submit | _Abort] | None:
        with self._wakeup:
            while not self._commands and not self.engine.has_work and not self._stopping:
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _iterate(self, commands: list[_Submit | _Abort]) -> None:
        for command in commands:
            self._apply(command)
        if self.engine.has_work:
            self._step()
        self._update_gauges()

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Submit):
            self._admit(command)
        else:
            self._abort(command.stream)

    def _admit(self, command: _Submit) -> None:
        stream = command.stream
        try:
            first = self._tracked.get(command.after.request_id) if command.after is not None else None
            req = self.engine.add_request(command.prompt_ids, command.params, command.budget,
                                          after=first.request if first is not None else None)
        except Exception as err:  # RequestError, QueueFullError: the handler maps it
            _post(stream.loop, _settle, stream.admitted, err)
            return
        stream.request_id = req.request_id
        if command.speculation:
            req.recent_trees = []  # (kept by the engine's RecentTrees, when it keeps trees)
        self._tracked[req.request_id] = _Tracked(req, stream, command.arrival, speculation=command.speculation)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        _post(stream.loop, _settle, stream.admitted, None)

    def _abort(self, stream: RequestStream) -> None:
        tracked = self._tracked.pop(stream.request_id, None) if stream.request_id else None
        if tracked is None:
            return  # finished meanwhile, or never admitted
        self.engine.abort(tracked.request.request_id)
        self.metrics.finished.labels(finish_reason="abort").inc()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except TensorParallelError:
            raise  # (the engine is lost: _run fails everything)
        except Exception as err:  # noqa: BLE001 - fail the batch, keep serving
            self._fail_active(_incident("engine step failed; failing the requests in the batch", err))
            return
        self.metrics.observe_round_nodes(self.engine.last_round_nodes)
        now = time.monotonic()
        deliveries = defaultdict(list)
        step_rounds, generated = _StepRounds(), 0
        for event in events:
            tracked = self._tracked.get(event.request.request_id)
            if tracked is not None:
                step_rounds.add(tracked)
                generated += len(event.new_token_ids)
                deliveries[tracked.stream.loop].append((tracked.stream, self._delta(tracked, event, now)))
        if generated:  # the step's counters once, not once per request (host time the device waits for)
            self.metrics.count_generated(generated, self.replica)
        self.metrics.observe_rounds(step_rounds.lengths, step_rounds.sizes)
        for loop, batch in deliveries.items():
            _post(loop, _deliver, batch)

    def _delta(self, tracked: _Tracked, event: StepEvent, now: float) -> GenerationDelta:
        req = event.request
        self._observe_token_times(tracked, len(event.new_token_ids), now)
        logprobs = None if event.new_logprobs is None else self._token_texts.entries(event.new_logprobs)
        speculation = self._speculation(tracked) if tracked.speculation else None
        if not event.finished:
            return GenerationDelta(tuple(event.new_token_ids), event.new_text, None, logprobs=logprobs,
                                   speculation=speculation)
        del self._tracked[req.request_id]
        self.metrics.finished.labels(finish_reason=req.finish_reason).inc()
        return GenerationDelta(tuple(event.new_token_ids), event.new_text, RequestUsage.of(req),
                               finish_reason=req.finish_reason, full_text=req.text, logprobs=logprobs,
                               stopped_by=req.stopped_by, speculation=speculation)

    def _speculation(self, tracked: _Tracked) -> dict:
        """The rounds since the last delta, and the newest draft tree if it is new (token texts added)."""
        req = tracked.request
        rounds = req.stats.acceptance_lengths[tracked.rounds_shown:]
        tracked.rounds_shown = len(req.stats.acceptance_lengths)
        info: dict = {"rounds": list(rounds)}
        trees = req.recent_trees or []
        if trees and trees[-1]["round"] != tracked.tree_shown:
            tree = trees[-1]
            tracked.tree_shown = tree["round"]
            info["tree"] = {"tokens": tree["tokens"], "parents": tree["parents"],
                            "accepted_path": tree["accepted_path"],
                            "texts": [self._token_texts(t) for t in tree["tokens"]]}
        return info

    def _observe_token_times(self, tracked: _Tracked, count: int, now: float) -> None:
        if count == 0:
            return
        if tracked.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            per_token = (now - tracked.last_token_at) / count
            for _ in range(count):
                self.metrics.inter_token_latency.observe(per_token)
        tracked.last_token_at = now

    def _fail_active(self, message: str) -> None:
        for req in list(self.engine.scheduler.active):
            self.engine.abort(req.request_id)
            tracked = self._tracked.pop(req.request_id, None)
            if tracked is not None:
                self._send_error(tracked, message)

    def _fail_all(self, message: str) -> None:
        for tracked in list(self._tracked.values()):
            self._send_error(tracked, message, lost=self.fatal_error is not None)
        self._tracked.clear()
        with self._wakeup:
            pending = [c for c in self._commands if isinstance(c, _Submit)]
            self._commands.clear()
        for command in pending:
            _post(command.stream.loop, _settle, command.stream.admitted, EngineUnavailable(message))

    def _send_error(self, tracked: _Tracked, message: str, lost: bool = False) -> None:
        self.metrics.finished.labels(finish_reason="error").inc()
        delta = GenerationDelta((), "", RequestUsage.of(tracked.request), error=message, lost=lost)
        _post(tracked.stream.loop, _deliver, [(tracked.stream, delta)])

    def _update_gauges(self) -> None:
        scheduler, pool = self.engine.scheduler, self.engine.pages.pool
        self.metrics.set_load(running=len(scheduler.active), waiting=len(scheduler.waiting),
                              used_pages=pool.used_pages, pages=pool.capacity, replica=self.replica)
        if self.engine.prefix_cache is not None:
            self.metrics.set_prefix_cache(self.engine.prefix_cache, self.replica)
        self.metrics.set_graphs(*self.engine.graph_counts, replica=self.replica)


class _StepRounds:
    """The rounds one engine step added to its requests' stats, gathered for one metrics update."""

    def __init__(self):
        self.lengths: list[int] = []  # acceptance lengths
        self.sizes: list[int] = []  # tree sizes

    def add(self, tracked: _Tracked) -> None:
        stats = tracked.request.stats
        self.lengths += stats.acceptance_lengths[tracked.rounds_seen:]
        self.sizes += stats.tree_sizes[tracked.rounds_seen:]
        tracked.rounds_seen = len(stats.acceptance_lengths)


def _incident(what: str, err: Exception) -> str:
    """Log ``err`` with its trace under a new incident id; returns what the clients are told."""
    incident = uuid.uuid4().hex[:12]
    log.error("%s (incident %s)", what, incident, exc_info=err)
    return f"internal error (id {incident}); the server log has the details"


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` (from the engine thread); a closed loop drops it."""
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
