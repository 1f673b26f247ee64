"""DFlash: the drafter's argmax at each of its b-1 draft positions, verified as a chain."""

from __future__ import annotations

from flashtree.speculative.drafter import DrafterProposer, DrafterRunner
from flashtree.speculative.proposer import RoundRows
from flashtree.speculative.tree.draft_tree import DraftTree, chain_tree


class DFlashProposer(DrafterProposer):
    """The chain of the first ``nodes`` argmax tokens of one drafter pass."""

    name = "dflash"
    chain = True

    def __init__(self, runner: DrafterRunner):
        super().__init__(runner, max_nodes=runner.drafter.config.block_size - 1)

    def propose(self, rows: RoundRows, nodes: int) -> DraftTree:
        draft = self.runner.draft_logits(rows, depth=nodes).argmax(dim=-1)  # [B, nodes] draft indices
        return chain_tree(self.runner.token_ids(draft))  # [B, nodes + 1] nodes
