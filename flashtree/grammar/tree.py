"""Draft trees that hold only what the grammar allows, and the masks a constrained row is verified under.

A grammar row's tree is the best ``budget`` prefixes of the drafter's factorized distribution among
the prefixes the grammar allows (DDTree), or the drafter's best allowed token at each depth (a
DFlash chain): a forbidden node is never verified, and the budget goes to allowed ones instead. The
target's choice at every node is taken under the grammar's mask after that node's path, which is
exactly the mask plain decoding applies after the same tokens, so constrained decoding stays
lossless whatever the tree holds.

Glossary
- L: depths the drafter proposes; K: candidate tokens per depth (the drafter's top-K, best first).
- W: int32 words of a token bitmask (``backends.bitmask_words``).
- node axis, root, valid, parents, ...: as in ``speculative/tree/draft_tree.py``; node 0 is the
  root (the bonus token, which the matcher has already accepted).

Best-first over prefixes: a node's weight is the sum of its tokens' log-probabilities, never more
than its parent's, and each depth's candidates come best first; so popping the heaviest frontier
entry, then offering that node's first allowed child and its parent's next allowed child, yields
the allowed prefixes heaviest first (nodes after their parents).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch

from flashtree.grammar.backends import GrammarMatcher

ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


class GrammarTree(NamedTuple):
    """One row's constrained tree on the host; N entries on the node axis (invalid ones last)."""

    tokens: np.ndarray  # [N] int64; root = ROOT_TOKEN filler (-1), invalid = 0
    parents: np.ndarray  # [N] int64; root -1, invalid 0
    depths: np.ndarray  # [N] int64; invalid 0
    valid: np.ndarray  # [N] bool
    log_weights: np.ndarray  # [N] float32; root 0, invalid -inf
    bitmask: np.ndarray  # [N, W] int32: the tokens allowed after each valid node's path (all for invalid)


def grammar_tree(matcher: GrammarMatcher, log_probs: np.ndarray, tokens: np.ndarray, budget: int, size: int,
                 words: int, chain: bool = False) -> GrammarTree:
    """The row's tree of at most ``budget`` drafted nodes (``size`` = N entries, N > budget; ``words``
    = W per bitmask row).

    log_probs, tokens: ``[L, K]`` the drafter's candidates per depth, best first (target ids).
    chain: each node gets only its best allowed child (DFlash), else siblings too (DDTree).
    The matcher starts and ends at the root's state."""
    depth_limit, _ = tokens.shape
    masks = _Masks(size, words)
    parents, depths, node_tokens, weights = [-1], [0], [-1], [0.0]
    walker = _PathWalker(matcher, parents, node_tokens)
    open_nodes = [masks.fill(matcher, 0)]  # per node: something may follow it (not terminated)
    frontier: list[tuple[float, int, int, int, int]] = []  # (-weight, order, parent node, depth, rank)
    order = 0

    def offer(parent: int, depth: int, rank: int) -> None:
        nonlocal order
        if not open_nodes[parent]:
            return
        allowed = masks.first_allowed(parent, tokens[depth - 1], rank)
        if allowed is not None:
            heapq.heappush(frontier, (-(weights[parent] + float(log_probs[depth - 1, allowed])), order, parent,
                                      depth, allowed))
            order += 1

    if depth_limit:
        offer(0, 1, 0)
    while frontier and len(parents) <= budget:
        negative, _, parent, depth, rank = heapq.heappop(frontier)
        token = int(tokens[depth - 1, rank])
        if not chain:
            offer(parent, depth, rank + 1)  # the parent's next allowed candidate
        if not walker.go_below(parent, token):
            continue
        node = len(parents)
        parents.append(parent)
        depths.append(depth)
        node_tokens.append(token)
        weights.append(-negative)
        walker.entered(node)
        open_nodes.append(masks.fill(matcher, node))
        if depth < depth_limit:
            offer(node, depth + 1, 0)
    walker.back_to_root()
    return _laid_out(parents, depths, node_tokens, weights, masks.bitmask, size)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., W]`` int32 bitmask -> ``[..., vocab]`` bool (token t allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    unpacked = (bitmask[..., None] >> bits) & 1  # [..., W, 32]
    return unpacked.flatten(-2)[..., :vocab].bool()


def root_bitmask(matcher: GrammarMatcher, words: int) -> np.ndarray:
    """``[W]`` the tokens allowed at the matcher's state (all of them once it has terminated)."""
    masks = _Masks(1, words)
    masks.fill(matcher, 0)
    return masks.bitmask[0]


class _Masks:
    """Per-node token bitmasks ``[N, W]`` (all allowed until filled)."""

    def __init__(self, size: int, words: int):
        self.bitmask = np.full((size, words), ALL_ALLOWED, dtype=np.int32)
        self._view = torch.from_numpy(self.bitmask)  # the backends fill through torch (shared memory)

    def fill(self, matcher: GrammarMatcher, node: int) -> bool:
        """The node's mask from the matcher at its state; False (all allowed) once the matcher has
        terminated: after a stop token nothing follows, and what is chosen there is dropped."""
        if matcher.terminated:
            return False
        matcher.fill(self._view, node)
        return True

    def first_allowed(self, node: int, candidates: np.ndarray, start: int) -> int | None:
        """The first rank >= ``start`` whose candidate token the node's mask allows."""
        row = self.bitmask[node].view(np.uint32)
        for rank in range(start, len(candidates)):
            token = int(candidates[rank])
            if token >= 0 and (row[token >> 5] >> (token & 31)) & 1:
                return rank
        return None


class _PathWalker:
    """Moves the matcher between nodes of the tree being built (rollback to the common ancestor,
    then accept down)."""

    def __init__(self, matcher: GrammarMatcher, parents: list[int], tokens: list[int]):
        self.matcher, self.parents, self.tokens = matcher, parents, tokens
        self.path: list[int] = []  # nodes the matcher has accepted below the root, in order

    def _path_to(self, node: int) -> list[int]:
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def go_below(self, parent: int, token: int) -> bool:
        """Place the matcher at ``parent`` and accept ``token`` there; False (left at ``parent``) when
        the grammar refuses it."""
        target = self._path_to(parent)
        common = 0
        while common < min(len(target), len(self.path)) and target[common] == self.path[common]:
            common += 1
        self.matcher.rollback(len(self.path) - common)
        for node in target[common:]:
            if not self.matcher.accept(self.tokens[node]):
                raise RuntimeError(f"grammar matcher refused token {self.tokens[node]} it accepted before")
        self.path = target
        return self.matcher.accept(token)

    def entered(self, node: int) -> None:
        self.path = self.path + [node]

    def back_to_root(self) -> None:
        self.matcher.rollback(len(self.path))
        self.path = []


def _laid_out(parents: list[int], depths: list[int], tokens: list[int], weights: list[float], bitmask: np.ndarray,
              size: int) -> GrammarTree:
    """The nodes in pop order (parents first), then invalid entries up to ``size``."""
    count, pad = len(parents), size - len(parents)
    valid = np.zeros(size, dtype=bool)
    valid[:count] = True
    return GrammarTree(
        tokens=np.array(tokens + [0] * pad, dtype=np.int64),
        parents=np.array(parents + [0] * pad, dtype=np.int64),
        depths=np.array(depths + [0] * pad, dtype=np.int64),
        valid=valid,
        log_weights=np.array(weights + [-np.inf] * pad, dtype=np.float32),
        bitmask=bitmask,
    )
