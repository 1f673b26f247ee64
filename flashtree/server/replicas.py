"""Data parallelism: ``--data-parallel-size N`` engine replicas behind one server.

Each replica is a whole engine (its own scheduler, KV cache and prefix cache; tensor-parallel itself
with ``--tensor-parallel-size``) on its own engine thread (:class:`AsyncEngine`), on its own devices:
replica i takes ``cuda:(first + i*T) .. cuda:(first + i*T + T - 1)`` for tensor-parallel size T (on a
CPU every replica shares it). :class:`ReplicaSet` offers the endpoints what one :class:`AsyncEngine`
offers (submit, cancel, state, metrics) and routes each request with :class:`PrefixRouter`; the
choices of an n > 1 request all go to the replica of the first (they share its prompt's pages).
The replicas live in the server's process: their host work shares one interpreter.

A replica that fails to load stops the server (as one engine does); a replica that is lost (a worker
process died) loses them all: every request in flight on any replica gets 503 naming the cause and the
server exits.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.models.build import resolve_device
from flashtree.sampling import SamplingParams
from flashtree.server.async_engine import LOST_PREFIX, AsyncEngine, EngineState
from flashtree.server.metrics import ServerMetrics
from flashtree.server.router import PrefixRouter
from flashtree.server.stream import RequestStream


def replica_configs(config: EngineConfig, replicas: int) -> list[EngineConfig]:
    """Each replica's engine config: on CUDA, its own ``tensor_parallel_size`` devices after the
    previous replica's (an error when the machine has fewer); elsewhere ``config`` itself."""
    device = resolve_device(config.target.device)
    if device.type != "cuda":
        return [config] * replicas
    per_replica, first = config.parallel.tensor_parallel_size, device.index or 0
    needed, have = first + replicas * per_replica, torch.cuda.device_count()
    if needed > have:
        raise ConfigError(f"--data-parallel-size {replicas} x --tensor-parallel-size {per_replica} from cuda:{first} "
                          f"needs {needed} CUDA devices, this machine has {have}")
    return [dataclasses.replace(config, target=dataclasses.replace(config.target,
                                                                   device=f"cuda:{first + i * per_replica}"))
            for i in range(replicas)]


class ReplicaSet:
    """Several :class:`AsyncEngine` replicas with one engine's interface (see the module docstring).
    ``make_replica(index, on_load_failure, on_fatal)`` builds replica ``index``."""

    def __init__(self, replicas: int, make_replica: Callable[..., AsyncEngine], metrics: ServerMetrics,
                 router: PrefixRouter, on_load_failure: Callable[[BaseException], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        self.metrics, self.router = metrics, router
        self._on_load_failure, self._on_fatal = on_load_failure, on_fatal
        self._lost_once = threading.Lock()
        self.fatal_error: str | None = None
        self.replicas: list[AsyncEngine] = [
            make_replica(i, on_load_failure=self._load_failed, on_fatal=lambda cause, i=i: self._lost(i, cause))
            for i in range(replicas)]

    # ------------------------------------------------------------------ what the endpoints use
    @property
    def state(self) -> EngineState:
        """FAILED when any replica failed, LOADING while any loads, READY when all are ready, else STOPPED."""
        states = [replica.state for replica in self.replicas]
        for state in (EngineState.FAILED, EngineState.LOADING, EngineState.STOPPED):
            if state in states:
                return state
        return EngineState.READY

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def load_error(self) -> str | None:
        return next((f"replica {i}: {r.load_error}" for i, r in enumerate(self.replicas) if r.load_error), None)

    @property
    def engine(self):
        """Replica 0's :class:`LLMEngine` (the model every replica serves)."""
        return self.replicas[0].engine

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def stop(self, timeout: float = 30.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, budget: int | None = None,
                     arrival: float | None = None, after: RequestStream | None = None,
                     speculation: bool = False) -> RequestStream:
        """:meth:`AsyncEngine.submit` on the routed replica (``after``'s replica for a later choice)."""
        if after is not None:
            index = after.replica
        else:
            route = self.router.route(prompt_ids, self.loads())
            index = route.replica
            self.metrics.observe_route(index, route.reason)
        stream = await self.replicas[index].submit(prompt_ids, params, budget, arrival, after, speculation)
        stream.replica = index
        return stream

    def cancel(self, stream: RequestStream) -> None:
        self.replicas[stream.replica].cancel(stream)

    def loads(self) -> list[int]:
        """Requests in flight on each replica."""
        return [replica.load for replica in self.replicas]

    # ------------------------------------------------------------------ failures
    def _load_failed(self, err: BaseException) -> None:
        if self._on_load_failure is not None:
            self._on_load_failure(err)

    def _lost(self, index: int, message: str) -> None:
        """Replica ``index`` is lost (``message``: its :meth:`AsyncEngine.fail` message): so are the
        others (their requests get 503 with the cause)."""
        cause = f"replica {index}: {message.removeprefix(LOST_PREFIX)}"
        with self._lost_once:
            if self.fatal_error is not None:
                return
            self.fatal_error = LOST_PREFIX + cause
        for replica in self.replicas:
            replica.fail(cause)
        if self._on_fatal is not None:
            self._on_fatal(self.fatal_error)
