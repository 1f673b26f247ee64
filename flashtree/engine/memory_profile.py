"""The activation reserve: device memory an engine's widest work needs beyond its weights and KV pages.

With ``gpu_memory_utilization`` the page pool takes the device's memory up to that fraction of its
total. The work that runs afterwards allocates on top of it: a round's logits for every verified
token, the sampler's sort, attention's partial sums, a prefill step's MLP activations; and the CUDA
graphs captured at start-up keep the widest graphed round's activations in their pool for good.
Like vLLM's profile run, the engine measures this before it sizes the pool: it runs its widest work
once on pad rows of a provisional cache that holds only the pad slot, and reserves

    the widest graphed round's peak (held by the graphs' pool)
  + the larger of the widest round's and the widest prefill step's peaks (the allocator's cache: rounds
    with no graph and prefill steps run outside the graphs' pool).

Glossary: a *peak* is the most memory the work held at once beyond what was held before (after emptying
the allocator's cache): the larger of the caching allocator's reserved growth (which counts its block
rounding) and its allocated growth (the tensors themselves, whatever room the allocator found for them:
on an H100 the tiny engine of tests/gpu/test_paged_kv.py measured 2-4 MiB of reserved growth for rounds
whose logits alone are 135 MB).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class ActivationReserve(NamedTuple):
    graphed_round: int  # bytes: the widest graphed round's peak (0 without start-up graphs)
    widest_round: int  # bytes: the widest round the engine may run (eagerly or graphed)
    prefill: int  # bytes: the widest prefill step

    @property
    def bytes(self) -> int:
        """What the pool leaves free for the work: the graphs' pool plus the allocator's own peak."""
        return self.graphed_round + max(self.widest_round, self.prefill)


def peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes ``run()`` held at its peak beyond what was held before (see the glossary)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_reserved(device) - reserved, torch.cuda.max_memory_allocated(device) - allocated)
