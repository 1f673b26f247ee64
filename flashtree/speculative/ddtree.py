"""DDTree: the ``budget`` most likely prefixes of the drafter's factorized distribution, as one tree.

Glossary
- budget: drafted nodes per tree (the root excluded); ``max_nodes`` is the most a round verifies,
  each round verifies ``nodes <= max_nodes`` (the speculation policy's choice), each row may ask
  for fewer (``rows.budgets``), and a round's per-row rule (``allot``) may keep fewer still.
"""

from __future__ import annotations

import torch

from flashtree.speculative.drafter import DrafterProposer, DrafterRunner
from flashtree.speculative.proposer import CANDIDATES, Refine, RoundRows
from flashtree.speculative.tree import build_tree
from flashtree.speculative.tree.build import Allot
from flashtree.speculative.tree.draft_tree import DraftTree


def default_budget(device: torch.device) -> int:
    """The budget when none is given: the one with the best tokens/s measured with the shipped
    SmolLM2 pair (greedy, one row, 128 new tokens): 64 on an H200 (1.91x plain), 4 on a 2-core CPU
    (1.14-1.24x; 2 was within noise, 8 and more cost more to verify than they gain). Under load the
    adaptive policy halves it as the batch grows, down to plain rounds."""
    return 64 if torch.device(device).type == "cuda" else 4


class DDTreeProposer(DrafterProposer):
    """The best ``budget`` prefixes of the drafter's marginals, as a tree (per-row budgets)."""

    name = "ddtree"
    chain = False

    def __init__(self, runner: DrafterRunner, budget: int, tree_kernel: bool = False):
        super().__init__(runner, max_nodes=budget)
        self.tree_kernel = tree_kernel  # the tree build and the accept walk in Triton kernels (same trees)

    def propose(self, rows: RoundRows, nodes: int, refine: Refine | None = None, allot: Allot | None = None
                ) -> DraftTree:
        depth = min(nodes, self.max_depth)  # a tree of n nodes is at most n deep
        logits = self.runner.draft_logits(rows, depth=depth)  # [B, depth, V] (V: the draft vocabulary's N)
        caps = rows.budgets.clamp(max=nodes)  # [B]
        tree = build_tree(logits, caps, nodes, kernel=self.tree_kernel, allot=allot)  # [B, nodes + 1]
        tree = self.runner.tree_token_ids(tree)
        if refine is not None:
            tree = refine(tree, self.runner.candidates(logits, max(nodes, CANDIDATES)))
        return tree
