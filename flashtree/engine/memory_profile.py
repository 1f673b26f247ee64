"""The activation reserve: device memory an engine's widest work needs beyond its weights and KV pages.

With ``gpu_memory_utilization`` the page pool takes the device's memory up to that fraction of its
total. The work that runs afterwards allocates on top of it: a round's logits for every verified
token, the sampler's sort, attention's partial sums, a prefill step's MLP activations; and the CUDA
graphs captured at start-up keep their rounds' activations in their pool for good.
Like vLLM's profile run, the engine measures this before it sizes the pool, on pad rows of a provisional
cache that holds only the pad slot, and reserves

    what the graphs start-up captures hold, captured there once in start-up's order and dropped: their
    pool (the rounds' activations, and what captures of different shapes lose to the pool's fragmentation,
    which can be a large share beside the widest round's own activations) and the graphs' own device
    memory (their launch data)
  + the larger of the widest round's and the widest prefill step's peaks (the allocator's cache: rounds
    with no graph and prefill steps run outside the graphs' pool). The widest round runs twice in a row,
    as serving repeats it: the second run may want blocks that the first run's freed blocks do not fit.

The throwaway capture also pays, before the pool is sized, what a process's first capture costs once
(an H100 measured 68 MiB in the allocator and 70 MiB outside it; a new stream's cuBLAS workspace is one
such cost, so graphs.warm_up_stream is one stream per device).

Glossary: a *peak* is the most memory the work held at once beyond what was held before (after emptying
the allocator's cache): the larger of the caching allocator's reserved growth (which counts its block
rounding) and its allocated growth (the tensors themselves, whatever room the allocator found for them:
on an H100 the tiny engine of tests/gpu/test_paged_kv.py measured 2-4 MiB of reserved growth for rounds
whose logits alone are 135 MB). What a thing *holds* is what dropping it gives back to the device, of the
allocator's reserved memory and outside it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class ActivationReserve(NamedTuple):
    graphed_round: int  # bytes: the graphs' pool, held for all the graphed rounds (0 without graphs)
    widest_round: int  # bytes: the peak of the widest round the engine may run (eagerly or graphed), twice
    prefill: int  # bytes: the widest prefill step's peak
    graph_memory: int = 0  # bytes: the graphs' own device memory outside their pool, all of them

    @property
    def bytes(self) -> int:
        """What the pool leaves free for the work: the graphs plus the allocator's own peak."""
        return self.graphed_round + self.graph_memory + max(self.widest_round, self.prefill)


def peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes ``run()`` held at its peak beyond what was held before (see the glossary)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_reserved(device) - reserved, torch.cuda.max_memory_allocated(device) - allocated)


def held_bytes(device: torch.device, make: Callable[[], object]) -> tuple[int, int]:
    """(bytes of the allocator's reserved memory, other bytes of the device) that what ``make()`` returns holds
    (see the glossary); ``make`` must return the only reference."""
    held = make()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, reserved = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    del held
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    pool = max(0, reserved - torch.cuda.memory_reserved(device))
    return pool, max(0, torch.cuda.mem_get_info(device)[0] - free - pool)
