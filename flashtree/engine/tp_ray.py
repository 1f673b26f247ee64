"""Tensor-parallel workers as Ray actors (``--distributed-executor ray``), as vLLM's Ray executor places them.

Ranks 1 .. W-1 run the same worker loop as the processes the engine starts itself
(``engine/tp_worker.py``), each in a Ray actor with a bundle of its own in one placement group (one CPU,
and one GPU on CUDA: Ray then shows the actor that GPU alone, as ``cuda:0``), on the Ray cluster that
``ray.init`` finds (``$RAY_ADDRESS``, else ``auto``: a running cluster, else a local one; a caller that
already called ``ray.init`` keeps its own). Rank 0 is the engine's process, as with processes.

The workers reach rank 0 over TCP: the process group's store (``TCPStore``) and a command connection
each (``multiprocessing.connection`` with a random key, the same send / recv as the pipes of local
workers), both at rank 0's node address. :class:`RayActorProcess` gives the executor what it asks of a
worker process (pid, a sentinel that closes when the actor's process is gone, join, exit status, kill).

Nothing imports this module (nor Ray) unless the Ray executor is chosen; Ray is the optional extra
``flashtree[ray]``.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing.connection import Client, Listener

import torch

from flashtree.config import EngineConfig
from flashtree.engine.tp_worker import WorkerSpec, run_worker
from flashtree.errors import ConfigError, FlashtreeError

ACCEPT_TIMEOUT_S = 300.0  # actors that have not connected by then fail the start (placement waits included)


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor ray needs Ray: pip install 'flashtree[ray]'") from None
    return ray


class RayActorProcess:
    """A worker actor seen as a process: ``done`` is its ``run`` call, which ends when its loop does."""

    def __init__(self, ray, actor, done, pid: int, conn):
        self._ray, self.actor, self.done, self.pid = ray, actor, done, pid
        self.sentinel = conn.fileno()  # (its end of the connection closes with its process)
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the actor's loop to end; then release the actor (its exit status:
        0 after a stop, 1 after an error it reported, -1 when its process died)."""
        if self.exitcode is not None:
            return
        ready, _ = self._ray.wait([self.done], timeout=timeout)
        if not ready:
            return
        try:
            self._ray.get(self.done)
            self.exitcode = 0
        except self._ray.exceptions.RayActorError:
            self.exitcode = -1
        except Exception:  # noqa: BLE001 (its loop raised or exited with an error: it sent the traceback)
            self.exitcode = 1
        self.kill()

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


def start_ray_workers(config: EngineConfig, world_size: int, store_port: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[list[tuple[int, RayActorProcess, object]], object]:
    """Ranks 1 .. ``world_size`` - 1 as Ray actors, started and connected: ([(rank, process, connection)],
    a callable that removes their placement group once they are stopped)."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
        except ConnectionError:  # (no cluster running: a local one)
            ray.init()
    gpus = 1 if device.type == "cuda" else 0
    bundles = [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in range(world_size - 1)]
    group = placement_group(bundles, strategy="PACK")
    ray.get(group.ready(), timeout=ACCEPT_TIMEOUT_S)
    host = ray.util.get_node_ip_address()
    authkey = secrets.token_bytes(32)
    actor_class = ray.remote(num_cpus=1, num_gpus=gpus)(TensorParallelActor)
    with Listener((host, 0), authkey=authkey) as listener:
        actors, runs = {}, {}
        for rank in range(1, world_size):
            spec = WorkerSpec(rank, world_size, store_port, config, "cuda:0" if gpus else str(device), dtype,
                              torch.get_num_threads(), store_host=host)
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1)
            actors[rank] = actor_class.options(scheduling_strategy=strategy, name=None).remote()
            runs[rank] = actors[rank].run.remote(spec, listener.address, authkey)
        conns = _accept(listener, world_size - 1)
    workers = [(rank, RayActorProcess(ray, actors[rank], runs[rank], pid, conn), conn)
               for rank, (conn, pid) in sorted(conns.items())]
    return workers, lambda: remove_placement_group(group)


def _accept(listener: Listener, count: int) -> dict[int, tuple[object, int]]:
    """Each worker's (command connection, process id), by the rank it announces first."""
    listener._listener._socket.settimeout(ACCEPT_TIMEOUT_S)  # (multiprocessing's Listener has no timeout of its own)
    conns = {}
    for _ in range(count):
        try:
            conn = listener.accept()
        except TimeoutError:
            raise FlashtreeError(f"{count - len(conns)} tensor-parallel Ray actors did not connect within "
                                 f"{ACCEPT_TIMEOUT_S:g} s (is the cluster's placement group pending?)") from None
        _, rank, pid = conn.recv()
        conns[rank] = conn, pid
    return conns


class TensorParallelActor:
    """A Ray actor holding one worker rank (made a remote class by :func:`start_ray_workers`)."""

    def run(self, spec: WorkerSpec, address, authkey: bytes) -> None:
        """Connect to rank 0 and run the worker loop until ``stop`` (or rank 0 is gone)."""
        conn = Client(address, authkey=authkey)
        conn.send(("rank", spec.rank, os.getpid()))  # (the actor runs one call at a time: this one, to the end)
        run_worker(spec, conn)
