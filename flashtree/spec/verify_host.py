"""The accept walk with numpy on the host: the same result as ``verify.accept_walk``'s torch ops.

On a CPU the torch walk is some 25 small ops whatever the tree's size (0.4-0.5 ms of a 20 ms
DDTree-4 round of SmolLM2 on a 2-core EPYC); here it is a loop over the depth of a few numpy ops
on ``[R, N]`` arrays. The rule is the one of ``verify.py``: from the root, move to the
lowest-index valid non-root child whose token is the target's choice at the current node, at
most ``max_depth`` times (tests/test_verify.py checks both paths against a plain-Python oracle
and each other).

Glossary: as in ``verify.py`` (R rows, N nodes per row, P = max_depth + 1 path slots).
"""

from __future__ import annotations

import numpy as np
import torch

from flashtree.spec.tree import ROOT, DraftTree
from flashtree.spec.verify import PATH_PAD, AcceptResult


def accept_walk_on_host(tree: DraftTree, target_choice: torch.Tensor, max_depth: int) -> AcceptResult:
    """``verify.accept_walk`` for CPU tensors. tree: N nodes per row; target_choice: [R, N] int64."""
    tokens, parents = tree.tokens.numpy(), tree.parents.numpy()  # [R, N] each
    choice = target_choice.numpy()  # [R, N]
    num_rows, num_nodes = tokens.shape
    walkable = tree.valid.numpy() & (np.arange(num_nodes) != ROOT)  # [R, N]
    rows = np.arange(num_rows)
    path = np.full((num_rows, max_depth + 1), PATH_PAD, dtype=np.int64)  # [R, P]
    path[:, 0] = ROOT
    current = np.full(num_rows, ROOT, dtype=np.int64)  # [R]
    walking = np.ones(num_rows, dtype=bool)  # [R]
    for step in range(1, max_depth + 1):
        wanted = choice[rows, current]  # [R]
        match = walkable & (parents == current[:, None]) & (tokens == wanted[:, None])  # [R, N]
        walking &= match.any(axis=1)
        if not walking.any():
            break
        current = np.where(walking, match.argmax(axis=1), current)  # argmax: the lowest matching index
        path[walking, step] = current[walking]
    committed = np.where(path != PATH_PAD, tokens[rows[:, None], np.maximum(path, 0)], PATH_PAD)  # [R, P]
    return AcceptResult(
        path=torch.from_numpy(path),
        accept_lengths=torch.from_numpy((path != PATH_PAD).sum(axis=1)),
        next_bonus=torch.from_numpy(choice[rows, current].astype(np.int64)),
        committed_tokens=torch.from_numpy(committed.astype(np.int64)),
    )
