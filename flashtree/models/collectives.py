"""The collectives a tensor-parallel target calls, over one torch.distributed process group.

The group is made from a TCP store directly (``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on
CUDA) rather than through ``init_process_group``: no process-wide default group, so several engines
(each with its own workers) can live in one process, and closing one leaves the others alone. Every
collective waits at most the group's timeout; a rank that dies makes the others' collective fail
(gloo notices the closed connection at once).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from flashtree.errors import FlashtreeError


class CollectiveError(FlashtreeError):
    """A collective failed: another rank closed its connection, or did not join within the timeout."""


def make_group(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float):
    """The process group of ``world_size`` ranks meeting at ``store`` (blocks until all have joined):
    NCCL for CUDA tensors, gloo otherwise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class Collectives:
    """All-reduce, broadcast and gather of one rank of ``group`` (rank 0 is the engine's process)."""

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        _wait(self.group.allreduce([tensor]), "all-reduce")
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        _wait(self.group.broadcast([tensor], options), "broadcast")
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on rank 0; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        tensor = tensor.contiguous()
        if self.rank != 0:
            _wait(self.group.gather([], [tensor], options), "gather")
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        _wait(self.group.gather([parts], [tensor], options), "gather")
        return parts


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as err:  # (gloo's and NCCL's errors: a closed connection, a timeout)
        raise CollectiveError(f"{what} failed: {err}") from err
