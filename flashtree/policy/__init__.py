"""Speculation policies: how many drafted nodes each round verifies (``base``: the interface and the
fixed count; ``adaptive``: the throughput-maximizing choice over ``estimates`` of each option;
``learned`` and ``memory``: what it learned, kept across processes)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flashtree.config import SpeculationConfig, round_tokens_for
from flashtree.policy.adaptive import AdaptivePolicy
from flashtree.policy.base import PLAIN_NODES, FixedNodes, Policy, node_ladder, rows_bucket

if TYPE_CHECKING:
    from flashtree.policy.memory import PolicyMemory

__all__ = ["AdaptivePolicy", "FixedNodes", "PLAIN_NODES", "Policy", "make_policy", "node_ladder", "rows_bucket"]


def make_policy(config: SpeculationConfig, max_nodes: int, chain: bool, device_type: str = "cuda",
                graph_tokens: int | None = None, memory: PolicyMemory | None = None,
                max_round_tokens: int | None = None) -> Policy:
    """The adaptive policy over the ladder of ``max_nodes`` (a chain: all or nothing), or every
    round at ``max_nodes`` when adaptive speculation is off or there is nothing to draft.
    ``device_type``: where it runs (the default round-size cap depends on it); ``graph_tokens``: the
    largest round with a CUDA graph (the cap where the device has none by default); ``memory``: what
    the adaptive policy starts from and keeps (``policy/memory.py``); ``max_round_tokens``: the scheduler's
    bound on a round's verified tokens (``SchedulerConfig.max_round_tokens``), for either policy."""
    if max_nodes == 0:
        return FixedNodes(PLAIN_NODES)
    if not config.adaptive:
        if max_round_tokens is None:
            return FixedNodes(max_nodes)
        return FixedNodes(max_nodes, node_ladder(max_nodes, chain, config.policy.min_tree_nodes), max_round_tokens)
    cap = round_tokens_for(config.policy, device_type)
    cap = graph_tokens if cap is None else cap
    if max_round_tokens is not None:
        cap = max_round_tokens if cap is None else min(cap, max_round_tokens)
    policy = dataclasses.replace(config.policy, max_round_tokens=cap)
    adaptive = AdaptivePolicy(node_ladder(max_nodes, chain, policy.min_tree_nodes), policy)
    if memory is not None:
        memory.attach(adaptive)
    return adaptive
