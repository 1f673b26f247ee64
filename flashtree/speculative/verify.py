"""The accept walk: which drafted nodes the target agrees with, for chains and trees alike.

Glossary
- R: rows (running requests) in the batch; N = B + 1 entries on the node axis (0 = root).
- target choice: the target's own next token (argmax or sample) after a node's root path.
- path: the accepted nodes in order, starting at the root; -1 after its end.
- accept length: nodes on the path, root included = tokens committed this round.
- next bonus: the target's choice at the last path node; the root of the next round.

Rule: from the root, with y the target's choice at the current
node, move to the valid child whose token is y (siblings carry distinct tokens, so there is
at most one) and repeat; stop when there is none. Every committed token is the target's own
choice given the true prefix, so decoding stays lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.kernels import gpu as gpu_kernels
from flashtree.kernels.gpu import tree as tree_kernels
from flashtree.speculative.tree import ROOT, DraftTree

PATH_PAD = -1  # path / committed-token filler after the end of the accepted path


class AcceptResult(NamedTuple):
    """One round's outcome per row; P = max_depth + 1 path slots."""

    path: torch.Tensor  # [R, P] int64; node indices, path[:, 0] = ROOT, then PATH_PAD
    accept_lengths: torch.Tensor  # [R] int64; nodes on the path, root included
    next_bonus: torch.Tensor  # [R] int64; target choice at the last path node
    committed_tokens: torch.Tensor  # [R, P] int64; tree.tokens at the path, then PATH_PAD


def accept_walk(
    tree: DraftTree, target_choice: torch.Tensor, max_depth: int | None = None, kernel: bool = False
) -> AcceptResult:
    """Walk each row's tree along the target's choices, without host syncs.

    tree: a DraftTree with N nodes per row. target_choice: [R, N] int64.
    max_depth: deepest node depth (L for DDTree / DFlash); defaults to N - 1, always enough.
    kernel: walk in one Triton kernel per row (``models/tree_kernels.accept_walk``; same result)
    where it can run (CUDA with Triton, or the interpreter).
    """
    num_rows, num_nodes = tree.tokens.shape
    if target_choice.shape != (num_rows, num_nodes):
        raise ValueError(
            f"target_choice must be [R, N] = [{num_rows}, {num_nodes}], "
            f"got shape {tuple(target_choice.shape)}"
        )
    if max_depth is None:
        max_depth = num_nodes - 1
    target_choice = target_choice.long()
    if kernel and gpu_kernels.usable_on(tree.tokens):
        return AcceptResult(*tree_kernels.accept_walk(tree.tokens, tree.parents, tree.valid, target_choice, max_depth))
    on_path = _path_nodes(tree, target_choice, max_depth)  # [R, N]
    # Path nodes have distinct depths 0..len-1: each goes to the slot of its depth.
    slot = torch.where(on_path, tree.depths, max_depth + 1)  # [R, N]; others to a dump slot
    node_index = torch.arange(num_nodes, device=tree.tokens.device).expand(num_rows, -1)
    path = torch.full((num_rows, max_depth + 2), PATH_PAD, dtype=torch.long,
                      device=tree.tokens.device)
    path = path.scatter_(1, slot, node_index)[:, : max_depth + 1]  # [R, P]
    accept_lengths = on_path.sum(dim=1)  # [R]
    current = path.gather(1, (accept_lengths - 1)[:, None])  # [R, 1]; last path node
    on_path = path != PATH_PAD  # [R, P]
    path_tokens = tree.tokens.gather(1, path.clamp(min=0))  # [R, P]
    return AcceptResult(
        path=path,
        accept_lengths=accept_lengths,
        next_bonus=target_choice.gather(1, current).squeeze(1),
        committed_tokens=torch.where(on_path, path_tokens, PATH_PAD),
    )


def _path_nodes(tree: DraftTree, target_choice: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[R, N] bool: the nodes the walk visits (root included), without a step loop.

    A node is a step of the walk from its parent when it is a valid non-root node carrying the
    target's choice at its parent and no lower-index sibling does too (the walk takes the first
    match). It is on the path when it and all its ancestors (ancestor_mask) are such steps and
    its depth is within max_depth.
    """
    num_rows, num_nodes = tree.tokens.shape
    node_index = torch.arange(num_nodes, device=tree.tokens.device)  # [N]
    parent = tree.parents.clamp(min=0)  # [R, N]; the root points at itself
    walkable = tree.valid & (node_index != ROOT)  # [R, N]
    match = walkable & (tree.tokens == target_choice.gather(1, parent))  # [R, N]
    no_match = torch.full_like(parent, num_nodes)  # [R, N]
    first_child = no_match.scatter_reduce(
        1, parent, torch.where(match, node_index, num_nodes), reduce="amin"
    )  # [R, N]; lowest matching child per node
    step = match & (first_child.gather(1, parent) == node_index)  # [R, N]
    step = step | (node_index == ROOT)  # [R, N]
    broken = (tree.ancestor_mask & ~step[:, None, :]).any(dim=2)  # [R, N]
    return ~broken & tree.valid & (tree.depths <= max_depth)  # [R, N]
