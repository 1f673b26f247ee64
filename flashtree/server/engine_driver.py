"""EngineDriver: the loop that owns one :class:`LLMEngine` while serving, on its own thread or process.

Glossary
- handle: what the driver knows a request's stream by. The front end's :class:`RequestStream`
  when the driver runs on a thread of the server's process; an integer key when it runs in an
  engine process (``server/engine_process.py``): the driver never looks inside it.
- inbox: the commands (submit, abort) the front end sent, and the order to stop (:class:`Inbox`).
- outbox: where the driver reports (:class:`Outbox`): the engine loaded or failed to, a request
  admitted or refused, a step's deltas, the engine lost for good.

The driver applies the inbox's commands between steps, runs ``step()`` while there is work and
waits on the inbox when idle (no spin). An exception from ``step()`` fails the requests that were
in the batch and the driver keeps serving the others; a lost engine (a tensor-parallel worker died)
is reported through ``outbox.lost`` and the front end stops everything.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Protocol

from flashtree.engine.engine import LLMEngine
from flashtree.engine.output import StepEvent
from flashtree.engine.request import Request
from flashtree.engine.tp_executor import TensorParallelError
from flashtree.sampling import SamplingParams
from flashtree.server.logprobs import TokenTexts
from flashtree.server.metrics import StepFigures
from flashtree.server.stream import EngineUnavailable, GenerationDelta, RequestUsage

log = logging.getLogger("flashtree.server")

SHUTTING_DOWN = "the server is shutting down"


@dataclasses.dataclass(frozen=True)
class Submit:
    handle: Any  # the request's stream (see the glossary)
    prompt_ids: list[int]
    params: SamplingParams
    budget: int | None
    arrival: float  # time.monotonic() when the HTTP request arrived (one clock for every process)
    after: Any = None  # the handle of a request with the same prompt to wait for (n > 1)
    speculation: bool = False  # its deltas carry its rounds and draft trees


@dataclasses.dataclass(frozen=True)
class Abort:
    handle: Any


class Outbox(Protocol):
    def loaded(self, engine: LLMEngine) -> None: ...
    def load_failed(self, error: BaseException) -> None: ...
    def settle(self, handle: Any, error: BaseException | None) -> None: ...  # admitted (None) or refused
    def deliver(self, batch: list[tuple[Any, GenerationDelta]]) -> None: ...
    def lost(self, cause: str) -> None: ...  # the engine cannot go on
    def flush(self) -> None: ...  # the end of an iteration: what was reported may go out now


class Inbox:
    """The commands for the driver, and the order to stop; any thread may put, the driver takes."""

    def __init__(self):
        self._commands: deque[Submit | Abort] = deque()
        self._wakeup = threading.Condition()
        self.stopping = False
        self.reason = SHUTTING_DOWN  # what requests still in flight are told when it stops
        self.lost = False  # it stopped because the engine is lost (their answer is 503, not 500)

    def __len__(self) -> int:
        return len(self._commands)

    def put(self, command: Submit | Abort) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def stop(self, reason: str = SHUTTING_DOWN, lost: bool = False) -> list[Submit | Abort]:
        """Stop the driver after its current step; returns (and drops) the commands not taken."""
        with self._wakeup:
            if not self.stopping:
                self.stopping, self.reason, self.lost = True, reason, lost
            pending = list(self._commands)
            self._commands.clear()
            self._wakeup.notify()
        return pending

    def take(self, idle: Callable[[], bool]) -> list[Submit | Abort] | None:
        """Every command queued, waiting for one while ``idle()``; None once stopping."""
        with self._wakeup:
            while not self._commands and idle() and not self.stopping:
                self._wakeup.wait()
            if self.stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands


@dataclasses.dataclass
class _Tracked:
    """The driver's bookkeeping of one admitted request."""

    request: Request
    handle: Any
    arrival: float
    last_token_at: float | None = None
    rounds_seen: int = 0
    speculation: bool = False  # its deltas carry its rounds and draft trees (GenerationDelta.speculation)
    rounds_shown: int = 0
    tree_shown: int = -1  # the round of the last tree sent


class EngineDriver:
    """Loads the engine with ``load()`` and serves the inbox until it stops (see the module docstring).
    ``metrics``: a :class:`~flashtree.server.metrics.ServerMetrics` or anything with its update methods."""

    def __init__(self, load: Callable[[], LLMEngine], metrics, inbox: Inbox, outbox: Outbox, replica: int = 0):
        self._load, self.metrics, self.inbox, self.outbox, self.replica = load, metrics, inbox, outbox, replica
        self.engine: LLMEngine | None = None
        self._tracked: dict[str, _Tracked] = {}  # request id -> bookkeeping
        self._ids: dict[Any, str] = {}  # handle -> request id, while admitted
        self._token_texts: TokenTexts | None = None  # for log-probabilities

    @property
    def admitted(self) -> int:
        return len(self._tracked)

    def run(self) -> None:
        if not self._load_engine():
            return
        while (commands := self.inbox.take(lambda: not self.engine.has_work)) is not None:
            try:
                self._iterate(commands)
            except TensorParallelError as err:
                self.inbox.stop(str(err), lost=True)
                self.outbox.lost(str(err))
            except Exception as err:  # noqa: BLE001 - a bug here must not stop the loop
                self._fail_active(_incident("engine loop failed; failing the requests in the batch", err))
                self.outbox.flush()
        self._fail_all(self.inbox.reason, self.inbox.stop())
        self.outbox.flush()
        self.engine.close_traces()
        self.engine.close()

    def _load_engine(self) -> bool:
        try:
            self.engine = self._load()
        except BaseException as err:  # noqa: BLE001 - reported to the front end (the CLI exits)
            log.error("loading the engine failed: %s", err)
            self.outbox.load_failed(err)
            return False
        self._token_texts = TokenTexts(self.engine.tokenizer)
        self.outbox.loaded(self.engine)
        self.engine.watch_workers(self.outbox.lost)
        return True

    def _iterate(self, commands: list[Submit | Abort]) -> None:
        for command in commands:
            if isinstance(command, Submit):
                self._admit(command)
            else:
                self._abort(command.handle)
        if self.engine.has_work:
            self._step()
        self._update_gauges()
        self.outbox.flush()

    def _admit(self, command: Submit) -> None:
        try:
            first = self._tracked.get(self._ids.get(command.after)) if command.after is not None else None
            req = self.engine.add_request(command.prompt_ids, command.params, command.budget,
                                          after=first.request if first is not None else None)
        except Exception as err:  # RequestError, QueueFullError: the handler maps it
            self.outbox.settle(command.handle, err)
            return
        if command.speculation:
            req.recent_trees = []  # (kept by the engine's RecentTrees, when it keeps trees)
        self._tracked[req.request_id] = _Tracked(req, command.handle, command.arrival, speculation=command.speculation)
        self._ids[command.handle] = req.request_id
        self.metrics.count_admitted(len(req.prompt_ids))
        self.outbox.settle(command.handle, None)

    def _abort(self, handle: Any) -> None:
        tracked = self._forget(self._ids.get(handle))
        if tracked is None:
            return  # finished meanwhile, or never admitted
        self.engine.abort(tracked.request.request_id)
        self.metrics.count_finished("abort")

    def _forget(self, request_id: str | None) -> _Tracked | None:
        tracked = self._tracked.pop(request_id, None) if request_id is not None else None
        if tracked is not None:
            del self._ids[tracked.handle]
        return tracked

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except TensorParallelError:
            raise  # (the engine is lost: run() stops)
        except Exception as err:  # noqa: BLE001 - fail the batch, keep serving
            self._fail_active(_incident("engine step failed; failing the requests in the batch", err))
            return
        now = time.monotonic()
        figures, batch = StepFigures(round_nodes=self.engine.last_round_nodes), []
        for event in events:
            tracked = self._tracked.get(event.request.request_id)
            if tracked is not None:
                batch.append((tracked.handle, self._delta(tracked, event, now, figures)))
        # the step's metrics in one call, not per request (host time the device waits for)
        self.metrics.observe_step(figures, self.replica)
        if batch:
            self.outbox.deliver(batch)

    def _delta(self, tracked: _Tracked, event: StepEvent, now: float, figures: StepFigures) -> GenerationDelta:
        req = event.request
        self._add_figures(tracked, len(event.new_token_ids), now, figures)
        logprobs = None if event.new_logprobs is None else self._token_texts.entries(event.new_logprobs)
        speculation = self._speculation(tracked) if tracked.speculation else None
        if not event.finished:
            return GenerationDelta(tuple(event.new_token_ids), event.new_text, None, logprobs=logprobs,
                                   speculation=speculation)
        self._forget(req.request_id)
        figures.finished.append(req.finish_reason)
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

    def _add_figures(self, tracked: _Tracked, count: int, now: float, figures: StepFigures) -> None:
        """The request's new rounds and token times, into the step's figures."""
        stats = tracked.request.stats
        figures.acceptance_lengths += stats.acceptance_lengths[tracked.rounds_seen:]
        figures.tree_sizes += stats.tree_sizes[tracked.rounds_seen:]
        tracked.rounds_seen = len(stats.acceptance_lengths)
        if count == 0:
            return
        figures.generated += count
        if tracked.last_token_at is None:
            figures.first_token_s.append(now - tracked.arrival)
        else:
            figures.inter_token.append(((now - tracked.last_token_at) / count, count))
        tracked.last_token_at = now

    def _fail_active(self, message: str) -> None:
        for req in list(self.engine.scheduler.active):
            self.engine.abort(req.request_id)
            tracked = self._forget(req.request_id)
            if tracked is not None:
                self._send_error(tracked, message)

    def _fail_all(self, message: str, pending: list[Submit | Abort]) -> None:
        """Answer every admitted request with ``message``, and refuse the submissions not taken."""
        for tracked in list(self._tracked.values()):
            self._send_error(tracked, message, lost=self.inbox.lost)
        self._tracked.clear()
        self._ids.clear()
        for command in pending:
            if isinstance(command, Submit):
                self.outbox.settle(command.handle, EngineUnavailable(message))

    def _send_error(self, tracked: _Tracked, message: str, lost: bool = False) -> None:
        self.metrics.count_finished("error")
        delta = GenerationDelta((), "", RequestUsage.of(tracked.request), error=message, lost=lost)
        self.outbox.deliver([(tracked.handle, delta)])

    def _update_gauges(self) -> None:
        scheduler, pool = self.engine.scheduler, self.engine.pages.pool
        self.metrics.set_load(running=len(scheduler.active), waiting=len(scheduler.waiting),
                              used_pages=pool.used_pages, pages=pool.capacity, replica=self.replica)
        if (cache := self.engine.prefix_cache) is not None:
            self.metrics.set_prefix_cache(queried_tokens=cache.queried_tokens, hit_tokens=cache.hit_tokens,
                                          cached_pages=cache.cached_pages, replica=self.replica)
        self.metrics.set_graphs(*self.engine.graph_counts, replica=self.replica)


def _incident(what: str, err: Exception) -> str:
    """Log ``err`` with its trace under a new incident id; returns what the clients are told."""
    incident = uuid.uuid4().hex[:12]
    log.error("%s (incident %s)", what, incident, exc_info=err)
    return f"internal error (id {incident}); the server log has the details"
