"""Tensor parallelism's rank 0: it starts the worker processes and mirrors the target's work to them.

Like vLLM's multiprocessing executor: the engine (scheduler, drafter, tree build, accept walk) runs
in this process, which is rank 0 and holds a shard of the target too; ranks 1 .. W-1 are worker
processes the engine starts itself (``torch.multiprocessing``, spawn; ``engine/tp_worker.py``), each
with its shard of the target and a KV cache of its KV heads. Whatever touches the target's KV cache
is mirrored:

- a target forward (prefill chunk, plain step, chain, tree): the sharded model's forward first sends
  its inputs (:meth:`TensorParallelExecutor.forward`), then every rank runs it, with one all-reduce
  per attention and MLP and the gather of the logits to rank 0 (``models/parallel.py``);
- a KV commit of a tree's accepted path: :class:`MirroredKVCache` sends it before moving its own entries;
- block-table writes (pages mapped, shared, released): :class:`MirroredPageTable` records them and
  the next command carries them.

Lengths need no mirroring: a forward's rows carry their committed lengths. The drafter runs on
rank 0 alone, from rank 0's whole embedding and LM head and the hidden states its forward keeps.

A worker that dies or hangs fails rank 0's next pipe write or collective (gloo notices a closed
connection at once; a hang waits ``worker_timeout_s``), and the engine raises
:class:`TensorParallelError` naming the rank and its exit status; the other workers are stopped.
:meth:`TensorParallelExecutor.watch` also reports a worker's death the moment its process exits, from
a thread of its own, so a server learns it while its engine is idle or blocked.
Rounds run eagerly: a replayed CUDA graph would skip the commands to the workers.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_any
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtree.config import EngineConfig
from flashtree.engine.tp_messages import PageWrites, pack_commit, pack_forward
from flashtree.engine.tp_worker import WorkerSpec, run_worker
from flashtree.errors import FlashtreeError
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.kv.pages import PageTable
from flashtree.models.batch import ForwardBatch
from flashtree.models.build import LoadedTarget
from flashtree.models.collectives import CollectiveError, Collectives, make_group
from flashtree.models.parallel_load import load_target_shard

STOP_WAIT_S = 5.0  # a stopped worker that has not exited after this long is terminated
EXIT_WAIT_S = 2.0  # after a failed collective, how long to wait for a dying worker's exit status
WATCH_POLL_S = 0.5  # how often the watcher thread checks whether the executor was closed


class TensorParallelError(FlashtreeError):
    """A tensor-parallel worker died, failed or stopped answering; the engine cannot go on."""

    exit_code = 1


class MirroredPageTable(PageTable):
    """Rank 0's block tables: every write is also kept for the workers (sent with the next command)."""

    def __init__(self, *args, **kwargs):
        self.pending: PageWrites = []
        super().__init__(*args, **kwargs)

    def _write(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        super()._write(rows, cols, pages)
        self.pending.append((list(rows), list(cols), list(pages)))

    def take_pending(self) -> PageWrites:
        pending, self.pending = self.pending, []
        return pending


class MirroredKVCache(KVCache):
    """Rank 0's shard of the target's KV cache: a commit (entries moved to the accepted path) runs on
    every rank."""

    def __init__(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, pages: MirroredPageTable,
                 executor: TensorParallelExecutor):
        super().__init__(spec, dtype, device, pages)
        self.executor = executor

    def commit(self, slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor,
               keep_counts: torch.Tensor) -> None:
        self.executor.commit(self, slots, starts, keep, keep_counts)
        super().commit(slots, starts, keep, keep_counts)


class _Process:
    """A worker process and rank 0's end of its pipe."""

    def __init__(self, rank: int, process, conn):
        self.rank, self.process, self.conn = rank, process, conn
        self.death: str | None = None  # what happened to it, once it has exited (see ``_death_of``)

    def describe(self) -> str:
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid})"


STARTUP_TIMEOUT_S = 300.0  # the least a worker gets to start and load its shard (a dead one is seen at once)


class TensorParallelExecutor:
    """Rank 0 of ``config.parallel.tensor_parallel_size`` ranks: starts the workers, loads its own shard
    (:attr:`target`), and mirrors the target's forwards and KV commits to the workers."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        parallel = config.parallel
        self.world_size, self.timeout_s = parallel.tensor_parallel_size, parallel.worker_timeout_s
        self.device = device
        self.failure: str | None = None  # why the workers are gone (no command is sent after that)
        self.pages: MirroredPageTable | None = None
        self._closing = False  # close() began: workers that exit now were stopped, not lost
        self._deaths = threading.Lock()  # (the engine thread and the watcher both read a dead worker's pipe)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, True,
                              timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self._release = None  # what else stopping the workers releases (a Ray placement group)
        if parallel.distributed_executor == "ray":
            self.workers = self._start_ray_workers(config, store.port, dtype)
        else:
            self.workers = self._start_workers(config, store.port, dtype)
        self._finalizer = weakref.finalize(self, _stop, self.workers, self._release)
        try:
            self._await("joining")
            group = make_group(store, 0, self.world_size, device, self.timeout_s)
            self.collectives = Collectives(group, 0, self.world_size)
            self.target: LoadedTarget = load_target_shard(config, device, dtype, self.collectives)
            self._await("ready")
        except BaseException:
            self.close()
            raise
        self.target.model.mirror = self
        self._store = store  # (the workers' group needs it while they run)

    def _start_workers(self, config: EngineConfig, port: int, dtype: torch.dtype) -> list[_Process]:
        context = mp.get_context("spawn")
        workers = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(rank, self.world_size, port, config, str(worker_device(self.device, rank)), dtype,
                              torch.get_num_threads())
            ours, theirs = context.Pipe()
            process = context.Process(target=run_worker, args=(spec, theirs), name=f"flashtree-tp{rank}", daemon=True)
            process.start()
            theirs.close()
            workers.append(_Process(rank, process, ours))
        return workers

    def _start_ray_workers(self, config: EngineConfig, port: int, dtype: torch.dtype) -> list[_Process]:
        from flashtree.engine.tp_ray import (
            start_ray_workers,  # (Ray is imported only when chosen)
        )

        started, self._release = start_ray_workers(config, self.world_size, port, dtype, self.device)
        return [_Process(rank, process, conn) for rank, process, conn in started]

    def _await(self, word: str) -> None:
        """Wait until every worker has said ``word`` (an error it sends, its death or the timeout raise).
        Start-up (importing torch, loading a shard) may take longer than a collective may wait: the
        wait is the longer of ``worker_timeout_s`` and :data:`STARTUP_TIMEOUT_S`."""
        timeout = max(self.timeout_s, STARTUP_TIMEOUT_S)
        for worker in self.workers:
            waitables = [worker.conn] + ([] if worker.process.sentinel == worker.conn.fileno() else [worker.process.sentinel])
            ready = wait_any(waitables, timeout=timeout)  # (a Ray actor's sentinel is its connection)
            if not ready:
                raise TensorParallelError(f"{worker.describe()} did not say {word!r} within {timeout:g} s")
            message = worker.conn.recv() if worker.conn.poll() else None
            if message is None or message[0] != word:
                raise TensorParallelError(self._death_of(worker) or f"{worker.describe()} sent {message!r}")

    # ------------------------------------------------------------------ what the engine makes through it
    def page_table(self, *args, **kwargs) -> MirroredPageTable:
        """The engine's block tables (``PageTable``'s arguments); their writes reach the workers."""
        self.pages = MirroredPageTable(*args, **kwargs)
        return self.pages

    def make_cache(self, spec: KVCacheSpec, dtype: torch.dtype) -> MirroredKVCache:
        """The target's KV cache on the :meth:`page_table`: rank 0's shard here, each worker's there."""
        pages = self.pages
        with self._guard():
            self._send(("cache", spec, dtype, pages.pool.num_pages, pages.max_slots,
                        pages.pages_per_slot * pages.page_size, pages.take_pending()))
        return MirroredKVCache(spec, dtype, self.device, pages, self)

    # ------------------------------------------------------------------ mirrored work
    @contextlib.contextmanager
    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None) -> Iterator[None]:
        """Around rank 0's forward: the workers get its inputs first (see ``models/parallel.ForwardMirror``)."""
        with self._guard():
            meta, ints, mask = pack_forward(batch, logits_index)
            self._send(("forward", meta, self.pages.take_pending()))
            self.collectives.broadcast(ints)
            self.collectives.broadcast(mask)
            yield

    def commit(self, cache: KVCache, slots: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor,
               keep_counts: torch.Tensor) -> None:
        """The workers make ``cache.commit``'s moves in their caches."""
        with self._guard():
            shape, ints = pack_commit(slots, starts, keep, keep_counts)
            self._send(("commit", shape, cache.commit_kernel, self.pages.take_pending()))
            self.collectives.broadcast(ints)

    def _send(self, message: tuple) -> None:
        for worker in self.workers:
            worker.conn.send(message)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Refuse work once the workers are gone; turn a failure inside into a clear error."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            yield
        except Exception as err:  # noqa: BLE001 (whatever failed, the workers are stopped first)
            self._fail(err)

    def _fail(self, err: Exception) -> NoReturn:
        """Stop every worker and raise: which worker died (its exit status, its traceback) when one
        did, else ``err`` itself (a collective that timed out names the timeout)."""
        dead = [text for worker in self.workers if (text := self._death_of(worker, EXIT_WAIT_S))]
        if dead:
            self.failure = "; ".join(dead)
        elif isinstance(err, (CollectiveError, OSError)):  # (a pipe write to a worker that is going)
            self.failure = f"the tensor-parallel workers stopped answering ({err})"
        else:
            self.failure = f"rank 0 failed ({type(err).__name__}: {err}); the workers were stopped"
        self.close()
        if dead or isinstance(err, (CollectiveError, OSError)):
            raise TensorParallelError(f"{self.failure}; the engine cannot continue") from err
        raise err

    def _death_of(self, worker: _Process, wait_s: float = 0.0) -> str | None:
        """What happened to ``worker`` if it has exited (within ``wait_s``): its exit status and the
        error it sent; None while it runs."""
        worker.process.join(wait_s)
        code = worker.process.exitcode
        if code is None:
            return None
        with self._deaths:
            if worker.death is None:
                worker.death = f"{worker.describe()} exited with status {code}{_sent_error(worker.conn)}"
        return worker.death

    def watch(self, on_death: Callable[[str], None]) -> None:
        """From now on, ``on_death(what happened)`` is called once, from a daemon thread, when a worker
        process exits before :meth:`close` (the engine cannot go on; its next forward raises too)."""
        sentinels = [worker.process.sentinel for worker in self.workers]
        watcher = threading.Thread(target=self._watch, args=(sentinels, on_death), name="flashtree-tp-watch",
                                   daemon=True)
        watcher.start()

    def _watch(self, sentinels: list[int], on_death: Callable[[str], None]) -> None:
        while not (ready := wait_any(sentinels, timeout=WATCH_POLL_S)):
            if self._closing:
                return
        if self._closing:
            return
        # (a closed sentinel may come a moment before the exit status)
        dead = [self._death_of(worker, EXIT_WAIT_S if worker.process.sentinel in ready else 0.0)
                for worker in self.workers]
        on_death("; ".join(text for text in dead if text) or "a tensor-parallel worker exited")

    def close(self) -> None:
        """Stop the workers (idempotent); the engine cannot run the target afterwards."""
        if self.failure is None:
            self.failure = "the tensor-parallel workers were stopped"
        self._closing = True
        self._finalizer()


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the CUDA device ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _sent_error(conn) -> str:
    """The traceback a dead worker sent before it exited (``":\n" + text``), or ""."""
    text = ""
    try:
        while conn.poll():
            message = conn.recv()
            if message[0] == "error":
                text += f":\n{message[1]}"
    except (EOFError, OSError):
        pass
    return text


def _stop(workers: list[_Process], release: Callable[[], None] | None = None) -> None:
    """Ask every worker to stop, then terminate those still running after ``STOP_WAIT_S``; then ``release()``."""
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send(("stop",))
    for worker in workers:
        worker.process.join(STOP_WAIT_S)
        if worker.process.is_alive():  # (SIGKILL: a stopped or hung process ignores SIGTERM)
            worker.process.kill()
            worker.process.join(STOP_WAIT_S)
        worker.conn.close()
    if release is not None:
        release()
