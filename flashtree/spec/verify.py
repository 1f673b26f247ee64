"""The accept walk: which drafted nodes the target agrees with, for chains and trees alike.

Glossary
- R: rows (running requests) in the batch; N = B + 1 entries on the node axis (0 = root).
- target choice: the target's own next token (argmax or sample) after a node's root path.
- path: the accepted nodes in order, starting at the root; -1 after its end.
- accept length: nodes on the path, root included = tokens committed this round.
- next bonus: the target's choice at the last path node; the root of the next round.

Rule (DESIGN.md sections 3 and 4): from the root, with y the target's choice at the current
node, move to the valid child whose token is y (siblings carry distinct tokens, so there is
at most one) and repeat; stop when there is none. Every committed token is the target's own
choice given the true prefix, so decoding stays lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.spec.tree import ROOT, DraftTree

PATH_PAD = -1  # path / committed-token filler after the end of the accepted path


class AcceptResult(NamedTuple):
    """One round's outcome per row; P = max_depth + 1 path slots."""

    path: torch.Tensor  # [R, P] int64; node indices, path[:, 0] = ROOT, then PATH_PAD
    accept_lengths: torch.Tensor  # [R] int64; nodes on the path, root included
    next_bonus: torch.Tensor  # [R] int64; target choice at the last path node
    committed_tokens: torch.Tensor  # [R, P] int64; tree.tokens at the path, then PATH_PAD


def accept_walk(
    tree: DraftTree, target_choice: torch.Tensor, max_depth: int | None = None
) -> AcceptResult:
    """Walk each row's tree along the target's choices, without host syncs.

    tree: a DraftTree with N nodes per row. target_choice: [R, N] int64.
    max_depth: deepest node depth (L for DDTree / DFlash); defaults to N - 1, always enough.
    """
    num_rows, num_nodes = tree.tokens.shape
    if target_choice.shape != (num_rows, num_nodes):
        raise ValueError(
            f"target_choice must be [R, N] = [{num_rows}, {num_nodes}], "
            f"got shape {tuple(target_choice.shape)}"
        )
    if max_depth is None:
        max_depth = num_nodes - 1
    device = tree.tokens.device
    target_choice = target_choice.long()
    node_index = torch.arange(num_nodes, device=device)  # [N]
    walkable = tree.valid & (node_index != ROOT)  # [R, N]
    current = torch.full((num_rows,), ROOT, dtype=torch.long, device=device)  # [R]
    moving = torch.ones(num_rows, dtype=torch.bool, device=device)  # [R]
    steps = [current]
    for _ in range(max_depth):
        choice = target_choice.gather(1, current[:, None])  # [R, 1]
        match = walkable & (tree.parents == current[:, None]) & (tree.tokens == choice)  # [R, N]
        moving = moving & match.any(dim=1)  # [R]
        child = match.long().argmax(dim=1)  # [R]; first (only) match
        current = torch.where(moving, child, current)  # [R]
        steps.append(torch.where(moving, child, PATH_PAD))
    path = torch.stack(steps, dim=1)  # [R, P]
    on_path = path != PATH_PAD  # [R, P]
    path_tokens = tree.tokens.gather(1, path.clamp(min=0))  # [R, P]
    return AcceptResult(
        path=path,
        accept_lengths=on_path.sum(dim=1),
        next_bonus=target_choice.gather(1, current[:, None]).squeeze(1),
        committed_tokens=torch.where(on_path, path_tokens, PATH_PAD),
    )
