"""A tensor-parallel worker process (ranks 1 .. W-1): its shard of the target, its KV cache, and the
loop that mirrors rank 0's target forwards and KV commits (``engine/tp_executor.py`` starts it).

The worker joins the process group, loads its shard, says ``ready``, then runs every command rank 0
sends (``engine/tp_messages.py``) until ``stop`` or until rank 0's end of the pipe closes (rank 0
is gone: the worker exits). An exception is sent back as ``("error", traceback)`` before the worker
exits with status 1, so rank 0 can say what went wrong.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import traceback

import torch
import torch.distributed as dist

from flashtree.config import EngineConfig
from flashtree.engine.tp_messages import (
    PageWrites,
    commit_buffer,
    forward_buffers,
    unpack_commit,
    unpack_forward,
)
from flashtree.kv.cache import KVCache
from flashtree.kv.pages import PagePool, PageTable
from flashtree.models.collectives import Collectives, make_group
from flashtree.models.parallel import ShardedCausalLM
from flashtree.models.parallel_load import load_target_shard


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled to it by the spawn start method)."""

    rank: int
    world_size: int
    store_port: int  # rank 0's TCP store, on ``store_host``
    config: EngineConfig
    device: str  # this rank's device: cpu, or cuda:<rank's index>
    dtype: torch.dtype
    threads: int  # torch CPU threads (rank 0's count)
    store_host: str = "127.0.0.1"  # rank 0's address (its node's IP when the workers are Ray actors)


def run_worker(spec: WorkerSpec, conn) -> None:
    """The worker process's entry point."""
    torch.set_num_threads(spec.threads)
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=spec.config.parallel.worker_timeout_s)
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.world_size, False, timeout=timeout)
        conn.send(("joining",))
        group = make_group(store, spec.rank, spec.world_size, device, spec.config.parallel.worker_timeout_s)
        collectives = Collectives(group, spec.rank, spec.world_size)
        model = load_target_shard(spec.config, device, spec.dtype, collectives).model
        conn.send(("ready",))
        Worker(model, collectives, device).serve(conn)
    except (EOFError, BrokenPipeError):  # rank 0 is gone
        return
    except BaseException:  # noqa: BLE001 (any failure goes back to rank 0 before the exit)
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            sys.exit(1)


class Worker:
    """One worker's shard, cache and block table, driven by rank 0's commands."""

    def __init__(self, model: ShardedCausalLM, collectives: Collectives, device: torch.device):
        self.model, self.collectives, self.device = model, collectives, device
        self.cache: KVCache | None = None

    def serve(self, conn) -> None:
        """Run rank 0's commands until ``stop`` (EOFError when rank 0 closes its end)."""
        handlers = {"cache": self._make_cache, "forward": self._forward, "commit": self._commit}
        while True:
            op, *args = conn.recv()
            if op == "stop":
                return
            handlers[op](*args)

    def _make_cache(self, spec, dtype: torch.dtype, num_pages: int, max_slots: int, max_tokens: int,
                    writes: PageWrites) -> None:
        """This rank's KV cache (its KV heads), on a block table that mirrors rank 0's."""
        pages = PageTable(PagePool(num_pages), max_slots, max_tokens, spec.page_size, self.device)
        self.cache = KVCache(spec, dtype, self.device, pages)
        self.model.setup_rope(spec.capacity + 1)  # (as the engine sets rank 0's)
        self._apply(writes)

    def _forward(self, meta, writes: PageWrites) -> None:
        self._apply(writes)
        ints, mask = forward_buffers(meta, self.device)
        self.collectives.broadcast(ints)
        self.collectives.broadcast(mask)
        batch, logits_index = unpack_forward(meta, ints, mask)
        self.model(batch, self.cache, logits_index=logits_index)

    def _commit(self, shape: tuple[int, int], commit_kernel: bool, writes: PageWrites) -> None:
        self._apply(writes)
        ints = self.collectives.broadcast(commit_buffer(shape, self.device))
        self.cache.commit_kernel = commit_kernel
        self.cache.commit(*unpack_commit(shape, ints))

    def _apply(self, writes: PageWrites) -> None:
        """Rank 0's block-table writes, in order."""
        table = self.cache.block_table
        for rows, cols, pages in writes:
            index = torch.tensor([rows, cols, pages], dtype=torch.long).to(self.device)  # [3, K]
            table[index[0], index[1]] = index[2]
