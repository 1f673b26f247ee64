"""What a request's stream carries from the engine to the endpoints: deltas, usage, and the
failures it can end with (each with its HTTP status).

A :class:`RequestStream` is read on the event loop; whatever runs the engine (a thread of the
server's process or an engine process, ``server/async_engine.py``) fills it between steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import AsyncIterator

from flashtree.engine.request import Request
from flashtree.server.logprobs import LogprobText

_KEYS = itertools.count()


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
        self.replica = 0  # the data-parallel replica serving it (server/replicas.py)
        self.key = next(_KEYS)  # unique in this process: what an engine process knows it by

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
