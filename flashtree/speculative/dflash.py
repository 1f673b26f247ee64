"""DFlash: the drafter's argmax at each of its b-1 draft positions, verified as a chain."""

from __future__ import annotations

from flashtree.speculative.drafter import DrafterProposer, DrafterRunner
from flashtree.speculative.proposer import CANDIDATES, Refine, RoundRows
from flashtree.speculative.tree.build import Allot
from flashtree.speculative.tree.draft_tree import DraftTree, chain_tree


class DFlashProposer(DrafterProposer):
    """The chain of the first ``nodes`` argmax tokens of one drafter pass."""

    name = "dflash"
    chain = True

    def __init__(self, runner: DrafterRunner):
        super().__init__(runner, max_nodes=runner.drafter.config.block_size - 1)

    def propose(self, rows: RoundRows, nodes: int, refine: Refine | None = None, allot: Allot | None = None
                ) -> DraftTree:
        """(``allot``: a chain is never passed one; the engine allots trees only.)"""
        logits = self.runner.draft_logits(rows, depth=nodes)  # [B, nodes, V]
        tree = chain_tree(self.runner.token_ids(logits.argmax(dim=-1)))  # [B, nodes + 1] nodes
        if refine is not None:
            tree = refine(tree, self.runner.candidates(logits, CANDIDATES))
        return tree
