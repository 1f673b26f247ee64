"""Which data-parallel replica serves a request: the one holding its prompt's prefix pages, else the
least loaded.

Each replica keeps the KV pages of the prompts it served (its prefix cache, ``kv/prefix_cache.py``), so
a conversation's next turn, whose prompt starts with the previous turn's prompt and answer, prefills only
its new tokens there. The router remembers, for the leading whole blocks of every prompt it routed
(``block_tokens`` tokens each, the page size), which replica last took them, by a hash chained over the
blocks (block i's hash covers blocks 0..i, as the prefix cache's does). A request goes to the replica of
its deepest remembered block (``affinity``), unless that replica has more than ``max_imbalance``
requests in flight above the least-loaded one; then, and when no block is remembered, to the least-loaded
replica (``least_loaded``; ties: the one routed fewer requests). The memory is bounded: the least
recently used blocks are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

LEADING_BLOCKS = 256  # blocks of a prompt the router hashes (4,096 tokens at 16-token pages)
REMEMBERED_BLOCKS = 1 << 18  # block hashes kept (about 30 MB)


class Route(NamedTuple):
    replica: int
    reason: str  # "affinity" | "least_loaded"
    matched_blocks: int  # leading blocks of the prompt remembered on the chosen replica (affinity only)


class PrefixRouter:
    """Routes requests over ``replicas`` replicas by prompt-prefix affinity (see the module docstring)."""

    def __init__(self, replicas: int, block_tokens: int, max_imbalance: int,
                 remembered_blocks: int = REMEMBERED_BLOCKS):
        if replicas < 1 or block_tokens < 1 or max_imbalance < 0:
            raise ValueError(f"PrefixRouter needs replicas >= 1, block_tokens >= 1, max_imbalance >= 0; got "
                             f"{replicas}, {block_tokens}, {max_imbalance}")
        self.replicas, self.block_tokens, self.max_imbalance = replicas, block_tokens, max_imbalance
        self.remembered_blocks = remembered_blocks
        self.routed = [0] * replicas  # requests routed to each replica
        self._owner: OrderedDict[int, int] = OrderedDict()  # chained block hash -> replica that last took it

    def route(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> Route:
        """The replica for a prompt, given each replica's requests in flight (``loads``); remembers the
        prompt's leading blocks on it."""
        hashes = self.block_hashes(prompt_ids)
        matched, owner = self._deepest_owner(hashes)
        least = min(range(self.replicas), key=lambda r: (loads[r], self.routed[r]))
        if owner is not None and loads[owner] - loads[least] <= self.max_imbalance:
            choice = Route(owner, "affinity", matched)
        else:
            choice = Route(least, "least_loaded", 0)
        self._remember(hashes, choice.replica)
        self.routed[choice.replica] += 1
        return choice

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the prompt's leading whole blocks (at most ``LEADING_BLOCKS``)."""
        blocks = min(len(prompt_ids) // self.block_tokens, LEADING_BLOCKS)
        hashes, previous = [], 0
        for i in range(blocks):
            previous = hash((previous, tuple(prompt_ids[i * self.block_tokens:(i + 1) * self.block_tokens])))
            hashes.append(previous)
        return hashes

    def _deepest_owner(self, hashes: list[int]) -> tuple[int, int | None]:
        """(blocks matched, replica) of the deepest remembered block; (0, None) when none is."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None:
                return depth, owner
        return 0, None

    def _remember(self, hashes: list[int], replica: int) -> None:
        for block_hash in hashes:
            self._owner[block_hash] = replica
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.remembered_blocks:
            self._owner.popitem(last=False)
