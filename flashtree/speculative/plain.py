"""Plain decoding as a proposer: no draft, one target token per round."""

from __future__ import annotations

from typing import Sequence

import torch

from flashtree.kernels.feature_sink import FeatureSink
from flashtree.speculative.drafter import DrafterLag
from flashtree.speculative.proposer import RoundRows
from flashtree.speculative.tree.draft_tree import DraftTree, root_only_tree


class PlainProposer:
    """The root-only tree every round; nothing to observe, defer or catch up."""

    name = "none"
    capture_layers: tuple[int, ...] = ()
    max_nodes = 0
    max_depth = 0
    chain = True
    tree_kernel = False

    def __init__(self):
        self.lag = DrafterLag(capacity=0)

    def propose(self, rows: RoundRows, nodes: int = 0, refine=None, allot=None) -> DraftTree:
        return root_only_tree(rows.bonus)

    def context_entry_bytes(self) -> int:
        return 0

    def attach_pages(self, pages) -> None:
        pass

    def observe(self, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        pass

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        pass

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink | None:
        return None

    def catch_up_rows(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        pass

    def release(self, slots: Sequence[int]) -> None:
        pass
