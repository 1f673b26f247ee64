"""The proposer protocol: what every decoding method gives the engine.

A proposer turns the running rows into a :class:`~flashtree.speculative.tree.DraftTree` whose root
is each row's bonus token; the engine verifies that tree with one target pass and walks it. Plain
decoding is the root-only tree, DFlash a chain, DDTree a best-first tree, so one round serves all
three. Proposers that read context features (DFlash drafters) get the target's hidden states of
every committed token, in plain rounds too: projected at once (:meth:`Proposer.observe`) or kept
for later (:meth:`Proposer.defer`, :meth:`Proposer.feature_sink`) and projected in one pass
(:meth:`Proposer.catch_up_rows`) when :class:`~flashtree.speculative.drafter.DrafterLag` says so.

Each round has a node count (``nodes``, the speculation policy's choice, at most ``max_nodes``):
the tree it verifies has ``nodes + 1`` entries on the node axis. A round of 0 nodes is plain: the
engine builds the root-only tree itself and never calls ``propose``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol, Sequence

import torch

from flashtree.kernels.feature_sink import FeatureSink
from flashtree.speculative.tree.build import Allot
from flashtree.speculative.tree.draft_tree import DraftTree

if TYPE_CHECKING:
    from flashtree.kv.pages import PageTable
    from flashtree.speculative.drafter import DrafterLag


class RoundRows(Protocol):
    """What a proposer sees of the running batch (the engine's round inputs)."""

    slots: torch.Tensor  # [B] int64
    bonus: torch.Tensor  # [B] int64, each row's bonus token
    starts: torch.Tensor  # [B] int64, position of the bonus token (= committed length)
    budgets: torch.Tensor  # [B] int64, per-row tree budget (DDTree), at most the round's nodes


class DraftCandidates(NamedTuple):
    """The drafter's best tokens per depth, for trees built under a constraint (``flashtree/grammar/``)."""

    log_probs: torch.Tensor  # [B, L, K] float32 log-probabilities, best first
    tokens: torch.Tensor  # [B, L, K] int64 target token ids


# a round's trees rebuilt from the candidates for the rows with a grammar: (trees, candidates) -> trees
Refine = Callable[[DraftTree, DraftCandidates], DraftTree]
CANDIDATES = 32  # candidates per depth a refined tree chooses from (DDTree: at least its node count)


class Proposer(Protocol):
    name: str
    capture_layers: tuple[int, ...]  # target layers whose outputs the proposer reads (empty: none)
    max_nodes: int  # drafted nodes per row at most (the tree budget); 0 for plain decoding
    max_depth: int  # deepest node
    chain: bool  # node i's parent is always i-1 (plain, DFlash): an accepted path needs no KV move
    tree_kernel: bool  # the accept walk may run as one Triton kernel per row
    lag: "DrafterLag"  # the host's count of each slot's deferred features (capacity 0: nothing deferred)

    def propose(self, rows: RoundRows, nodes: int, refine: Refine | None = None, allot: Allot | None = None
                ) -> DraftTree:
        """The round's trees with ``nodes`` drafted nodes per row (1 <= nodes <= max_nodes):
        every tensor has ``nodes + 1`` entries on the node axis. ``refine``: passed the trees and the
        drafter's candidates, it returns the trees to verify (rows with a grammar rebuilt).
        ``allot``: each row's budget from its tree's ranked path weights (``tree.build.Allot``;
        trees only: the engine passes it only to proposers whose ``chain`` is false)."""

    def context_entry_bytes(self) -> int:
        """Bytes of the proposer's own KV context per cached position (0: it keeps none)."""

    def attach_pages(self, pages: "PageTable") -> None:
        """Keep the proposer's own context cache (if any) on ``pages``, the engine's block tables:
        the pages the engine maps for a slot hold the slot's drafter context too."""

    def observe(self, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        """Project context features ``[B, P, F]`` of newly committed tokens at ``starts[b] + j``,
        j < counts[b], into the proposer's context."""

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        """Keep context features ``[B, P, F]`` (the first ``counts[b]`` of each row, default all)
        after the ``lags[b]`` tokens each row has deferred already, for a later catch-up."""

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink | None:
        """Where a plain round's forward writes its one new token's features per row (the place
        :meth:`defer` would put them); None: the forward returns them."""

    def catch_up_rows(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        """Project each row's ``counts[b]`` deferred features after the ``starts[b]`` tokens its
        context holds (all ``[B]`` device tensors; ``width`` >= the largest count). Capturable."""

    def release(self, slots: Sequence[int]) -> None:
        """Forget the finished requests of ``slots``."""
