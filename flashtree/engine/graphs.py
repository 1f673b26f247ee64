"""CUDA-graph replay of whole decode rounds.

A round (draft, tree build, verify, accept walk, commit) launches hundreds of small kernels; at
small batch on a fast GPU, launching them costs more than running them. Everything in a round
is sync-free tensor work, so :class:`GraphCache` captures it once per static key (rows, kv_len
bucket, sampling flags, slot layout) and replays it after copying the round's inputs into the
graph's static buffers. The engine captures the graphs it expects at start-up and then freezes the
cache: a key with no graph runs eagerly instead of stalling the rounds of every running request
for a capture.

Outputs are the graph's static buffers: they are overwritten by the next replay of the same
key, so callers consume them before the next call (the runner copies them to the host at once).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Hashable, NamedTuple, Sequence

import torch


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static input buffers
    output: object  # what the function returned (static buffers)


class GraphCache:
    """``run(key, fn, inputs)`` replays ``fn(*inputs)`` captured for ``key``; ``fn`` must be a pure
    device computation whose shapes depend only on ``key`` and the inputs' shapes."""

    def __init__(self, max_graphs: int = 512):
        self.max_graphs = max_graphs
        self.graphs: dict[Hashable, _Captured] = {}  # least recently used first
        self.pool = None
        self.captures = 0  # graphs captured so far (a capturing call is much slower than a replay)
        self.frozen = False  # no more captures: a missing key runs eagerly (see freeze)
        self.eager_runs = 0  # calls that ran eagerly because the cache was frozen without their key
        self.replays = 0  # graphs replayed so far, and the host seconds their replay() calls took (the
        self.replay_host_seconds = 0.0  # launch, which the device's work does not hide at small batch)

    def has(self, key: Hashable) -> bool:
        """A graph for ``key`` is captured (``run`` would replay it)."""
        return key in self.graphs

    def would_capture(self, key: Hashable) -> bool:
        """``run`` with ``key`` would capture a graph now (waiting for the device); a frozen cache runs a
        missing key eagerly instead."""
        return not self.frozen and key not in self.graphs

    def freeze(self) -> None:
        """From now on, ``run`` with a key that has no graph runs ``fn`` eagerly instead of capturing."""
        self.frozen = True

    def run(self, key: Hashable, fn: Callable, inputs: Sequence[torch.Tensor]):
        captured = self.graphs.pop(key, None)
        if captured is None and self.frozen:
            self.eager_runs += 1
            return fn(*inputs)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:  # evict the least recently used graph; running a
                self.graphs.pop(next(iter(self.graphs)))  # miss eagerly instead costs ~10x a replay
            captured = self._capture(fn, inputs)
            self.captures += 1
        self.graphs[key] = captured  # now the most recently used
        for static, live in zip(captured.inputs, inputs):
            static.copy_(live)
        t0 = time.perf_counter()
        captured.graph.replay()
        self.replay_host_seconds += time.perf_counter() - t0
        self.replays += 1
        return captured.output

    def _capture(self, fn: Callable, inputs: Sequence[torch.Tensor]) -> _Captured:
        static = tuple(t.clone() for t in inputs)
        stream = warm_up_stream(static[0].device if static else torch.device("cuda"))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*static)  # warm up kernels and the allocator outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with _no_collection(), torch.cuda.graph(graph, pool=self.pool):
            output = fn(*static)
        self.pool = graph.pool()
        return _Captured(graph, static, output)


_WARM_UP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of the process on ``device`` for every capture's warm-up run. One, because the
    allocator caches blocks per stream and cuBLAS keeps a workspace per stream for good: a stream per capture
    (or per engine) would keep each one's blocks and workspace, memory start-up's profile never saw."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARM_UP_STREAMS[device]


@contextlib.contextmanager
def _no_collection():
    """No garbage collection while a graph is captured: a collection there may destroy an unreachable
    object's CUDA graph (a dropped engine's, kept by a reference cycle), a call CUDA forbids during a
    capture, and the capture fails ("operation failed due to a previous error during capture")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
