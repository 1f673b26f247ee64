"""Continuous batching: which requests prefill and which decode in the next step.

Requests wait in FIFO order; the oldest is admitted when a slot is free and the page pool can
promise it every KV page it may reach (:class:`PageBudget`: its prompt and ``max_tokens``, capped
at ``max_context``, plus a round's scratch). Pages are mapped as the request grows and the promise
guarantees they are there, so a running request never waits for memory and nothing is preempted.
Admitted requests prefill one chunk per
step while the running ones keep decoding, and join the running batch once their prompt is in.
A step's prefill holds at most ``max_prefill_tokens`` padded prompt tokens (rows x the widest
chunk; the oldest admitted requests first, at least one), so a burst of arrivals does not stall
the running requests for more than one such batch.
A request with ``after`` set (a sibling of an n > 1 request) waits, at the head of the queue, until
that request's prompt is in, so it maps the prompt's cached pages instead of computing them again.
Finished or aborted requests leave between steps and free their slot and pages at once.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import NamedTuple

from flashtree.config import CacheConfig, SchedulerConfig, prefill_tokens_for
from flashtree.engine.request import Request, Status
from flashtree.errors import FlashtreeError, RequestError
from flashtree.kv.pages import pages_for


class QueueFullError(FlashtreeError):
    """The waiting queue holds ``max_waiting`` requests; try again later."""


class PromptTooLongError(RequestError):
    """The prompt leaves no room for output in ``max_context`` (HTTP 400 in the server)."""


@dataclasses.dataclass(frozen=True)
class PageBudget:
    """What admission promises in KV pages: ``capacity`` pages in all, pages of ``page_size``
    entries, and ``span`` positions past its committed context that a round may write."""

    capacity: int
    page_size: int
    span: int

    def need(self, req: Request, max_context: int) -> int:
        """Pages ``req`` may reach: its prompt and output (at most ``max_context``) and a round's scratch."""
        return pages_for(min(len(req.prompt_ids) + req.params.max_tokens, max_context) + self.span, self.page_size)


class ScheduledStep(NamedTuple):
    prefill: list[Request]  # requests that run a prompt chunk this step
    decode: list[Request]  # requests that run a round this step


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig = CacheConfig(), pages: PageBudget | None = None,
                 device_type: str = "cpu"):
        """``pages``: the page pool's budget (None: no page limit, the slots alone limit admission);
        ``device_type``: where the engine runs (the prefill budget's default depends on it)."""
        self.config = dataclasses.replace(config, max_prefill_tokens=prefill_tokens_for(config, device_type))
        self.max_context = cache.max_context
        self.pages = pages
        self.promised = 0  # pages promised to the admitted requests
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # prefilling or running, each with a slot
        self.admitted: list[Request] = []  # prefilling requests, oldest admission first
        self.free_slots: list[int] = list(range(config.max_running))

    def add(self, req: Request) -> None:
        if len(req.prompt_ids) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if len(req.prompt_ids) >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(req.prompt_ids)} tokens; the context holds {self.max_context} "
                f"(prompt + output), so at most {self.max_context - 1} prompt tokens are allowed")
        if self.pages is not None and self._need(req) > self.pages.capacity:
            raise RequestError(
                f"the request may reach {self._need(req)} KV pages of {self.pages.page_size} tokens (a "
                f"{len(req.prompt_ids)}-token prompt and max_tokens={req.params.max_tokens}) but the pool holds "
                f"{self.pages.capacity}; lower max_tokens or raise --kv-pages")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting={self.config.max_waiting})")
        self.waiting.append(req)

    def schedule(self) -> ScheduledStep:
        """:meth:`admit`, then :meth:`plan` (the engine calls them apart: it maps the admitted requests'
        cached prefixes in between)."""
        self.admit()
        return self.plan()

    def admit(self) -> list[Request]:
        """Give the oldest waiting requests that fit a slot and their pages; returns them."""
        admitted = []
        while self.waiting and self.free_slots and self._fits(self.waiting[0]) and _ready(self.waiting[0]):
            req = self.waiting.popleft()
            self.promised += self._need(req)
            req.slot = self.free_slots.pop(0)
            req.status = Status.PREFILLING
            self.active.append(req)
            self.admitted.append(req)
            admitted.append(req)
        return admitted

    def plan(self) -> ScheduledStep:
        """This step's prefill batch and decode rows."""
        self.active.sort(key=lambda r: r.slot)
        self.admitted = [r for r in self.admitted if r.status is Status.PREFILLING]
        prefill = self._prefill_batch()
        return ScheduledStep(
            prefill=sorted(prefill, key=lambda r: r.slot),
            decode=[r for r in self.active if r.status is Status.RUNNING],
        )

    def _prefill_batch(self) -> list[Request]:
        """The oldest prefilling requests whose next chunks fit ``max_prefill_tokens`` when padded
        to the widest of them (always at least one)."""
        chosen: list[Request] = []
        widest = 0
        for req in self.admitted:
            width = max(widest, min(self.config.prefill_chunk, len(req.prompt_ids) - req.prefilled))
            if chosen and (len(chosen) + 1) * width > self.config.max_prefill_tokens:
                break
            chosen.append(req)
            widest = width
        return chosen

    def release_finished(self) -> list[Request]:
        done = [r for r in self.active if r.finished]
        for req in done:
            self.free_slots.append(req.slot)
            self.promised -= self._need(req)
        self.free_slots.sort()
        self.active = [r for r in self.active if not r.finished]
        return done

    def _need(self, req: Request) -> int:
        return 0 if self.pages is None else self.pages.need(req, self.max_context)

    def _fits(self, req: Request) -> bool:
        return self.pages is None or self.promised + self._need(req) <= self.pages.capacity

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting) + self.active:
            if req.request_id == request_id and not req.finished:
                req.status, req.finish_reason = Status.FINISHED, "abort"
                if req in self.waiting:
                    self.waiting.remove(req)
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def num_running(self) -> int:
        return len(self.active)


def _ready(req: Request) -> bool:
    """``req`` waits for nothing: no ``after`` request, or that one's prompt is in (or it ended)."""
    return req.after is None or req.after.status in (Status.RUNNING, Status.FINISHED)
