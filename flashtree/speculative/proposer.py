"""The proposer interface shared by every decoding method, and the plain (no draft) proposer.

A proposer turns the running rows into a :class:`DraftTree` whose root is each row's bonus
token; the engine verifies that tree with one target pass and walks it. Plain decoding is the
root-only tree, DFlash a chain, DDTree a best-first tree, so one round serves all three.
Proposers that read context features (DFlash drafters) receive the target hidden states of
every committed token through :meth:`Proposer.observe`, in plain rounds too.

Each round has a node count (``nodes``, chosen by the engine's speculation policy, at most
``max_nodes``): the tree it verifies has ``nodes + 1`` entries on the node axis. A round of 0
nodes is plain: the engine builds the root-only tree itself and never calls ``propose``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from flashtree.speculative.tree.build import DraftTree


class ProposerRows(Protocol):
    """What a proposer sees of the running batch (built by the engine each round)."""

    slots: torch.Tensor  # [B] int64
    bonus: torch.Tensor  # [B] int64, each row's bonus token
    starts: torch.Tensor  # [B] int64, position of the bonus token (= committed length)
    budgets: torch.Tensor  # [B] int64, per-row tree budget (DDTree), at most the round's nodes


class Proposer(Protocol):
    name: str
    capture_layers: tuple[int, ...]  # target layers whose outputs the proposer reads
    max_nodes: int  # static number of drafted nodes per row (tree budget); 0 for plain
    max_depth: int  # deepest node
    chain: bool  # node i's parent is always i-1 (plain, DFlash): accepted paths need no KV move

    def propose(self, rows: ProposerRows, nodes: int) -> DraftTree:
        """The round's trees with ``nodes`` drafted nodes per row (1 <= nodes <= max_nodes):
        every tensor has ``nodes + 1`` entries on the node axis."""

    def observe(self, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        """Context features ``[B, P, F]`` of newly committed tokens at ``starts[b] + j`` for j < counts[b]."""

    def release(self, slots: Sequence[int]) -> None: ...


def root_only_tree(bonus: torch.Tensor) -> DraftTree:
    """The tree of plain decoding: just the bonus token. bonus ``[B]``."""
    rows = bonus.shape[0]
    device = bonus.device
    return DraftTree(
        tokens=bonus[:, None].clone(),  # [B, 1]
        parents=torch.full((rows, 1), -1, dtype=torch.long, device=device),
        depths=torch.zeros(rows, 1, dtype=torch.long, device=device),
        valid=torch.ones(rows, 1, dtype=torch.bool, device=device),
        ancestor_mask=torch.ones(rows, 1, 1, dtype=torch.bool, device=device),
        log_weights=torch.zeros(rows, 1, device=device),
    )


class PlainProposer:
    """Autoregressive decoding: no draft, one target token per round."""

    name = "none"
    capture_layers: tuple[int, ...] = ()
    max_nodes = 0
    max_depth = 0
    chain = True

    def propose(self, rows: ProposerRows, nodes: int = 0) -> DraftTree:
        return root_only_tree(rows.bonus)

    def observe(self, slots, features, counts, starts) -> None:
        pass

    def release(self, slots) -> None:
        pass
