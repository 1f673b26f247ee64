"""The draft tree every decoding method verifies, and the two fixed shapes of it.

A round verifies one tree per row whose root is the row's bonus token: plain decoding verifies the
root alone (:func:`root_only_tree`), DFlash a chain (:func:`chain_tree`), DDTree the best prefixes
of its drafter's distribution (:func:`~flashtree.speculative.tree.build.build_tree`).

Glossary
- R: rows (running requests) in the batch; N: entries on the node axis (the root and the drafted nodes).
- node axis: ``[root, node_1 .. node_{N-1}]``; index 0 is the root; parents come before their children.
- valid: a node that is part of the tree; padded / non-existent nodes are invalid.
- ancestor mask: ``[r, i, j]`` is true when node j is node i or one of its ancestors; a node attends
  to the committed context and to these nodes only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ROOT = 0  # node index of the root (the bonus token)
NO_PARENT = -1  # parent of the root
ROOT_TOKEN = -1  # filler in the root's token slot; the engine writes the bonus token there
PAD_TOKEN = 0  # token of invalid nodes (a legal id, so embedding lookups stay in range)


class DraftTree(NamedTuple):
    """A batch of draft trees with static shapes; N = B + 1 entries on the node axis."""

    tokens: torch.Tensor  # [R, N] int64; root slot = ROOT_TOKEN, invalid = PAD_TOKEN
    parents: torch.Tensor  # [R, N] int64; root = NO_PARENT, invalid = ROOT
    depths: torch.Tensor  # [R, N] int64; root 0, invalid 0
    valid: torch.Tensor  # [R, N] bool; root always True
    ancestor_mask: torch.Tensor  # [R, N, N] bool; [r, i, j] = j is i or an ancestor of i
    log_weights: torch.Tensor  # [R, N] float; root 0.0, invalid -inf


def chain_tree(draft_tokens: torch.Tensor) -> DraftTree:
    """The DFlash chain ``[bonus, d_1 .. d_L]`` as a tree: node i's parent is i-1, depth i.

    draft_tokens: [R, L] int64. Weights are unknown for a chain and reported as 0.0.
    """
    num_rows, depth = draft_tokens.shape
    device = draft_tokens.device
    root_tokens = torch.full((num_rows, 1), ROOT_TOKEN, dtype=torch.long, device=device)
    tokens = torch.cat([root_tokens, draft_tokens.long()], dim=1)  # [R, L+1]
    index = torch.arange(depth + 1, device=device)  # [L+1]
    parents = (index - 1).expand(num_rows, -1).contiguous()  # [R, L+1]; root -> -1
    depths = index.expand(num_rows, -1).contiguous()  # [R, L+1]
    valid = torch.ones(num_rows, depth + 1, dtype=torch.bool, device=device)  # [R, L+1]
    causal = torch.ones(depth + 1, depth + 1, dtype=torch.bool, device=device).tril()
    ancestor_mask = causal.expand(num_rows, -1, -1).contiguous()  # [R, L+1, L+1]
    log_weights = torch.zeros(num_rows, depth + 1, device=device)  # [R, L+1]
    return DraftTree(tokens, parents, depths, valid, ancestor_mask, log_weights)


def root_only_tree(bonus: torch.Tensor) -> DraftTree:
    """The tree of plain decoding: just the bonus token. bonus ``[R]``."""
    rows = bonus.shape[0]
    device = bonus.device
    return DraftTree(
        tokens=bonus[:, None].clone(),  # [R, 1]
        parents=torch.full((rows, 1), NO_PARENT, dtype=torch.long, device=device),
        depths=torch.zeros(rows, 1, dtype=torch.long, device=device),
        valid=torch.ones(rows, 1, dtype=torch.bool, device=device),
        ancestor_mask=torch.ones(rows, 1, 1, dtype=torch.bool, device=device),
        log_weights=torch.zeros(rows, 1, device=device),
    )


def narrowed(tree: DraftTree, width: int) -> DraftTree:
    """The first ``width`` entries of the node axis (``[R, width]``, the mask ``[R, width, width]``): the
    same trees when every valid node lies there (the DDTree build lays valid nodes out first)."""
    return DraftTree(tree.tokens[:, :width], tree.parents[:, :width], tree.depths[:, :width], tree.valid[:, :width],
                     tree.ancestor_mask[:, :width, :width], tree.log_weights[:, :width])
