"""Draft trees: the type every method verifies (``draft_tree``), DDTree's best tree for a budget built on the
device (``build``) or, for small CPU trees, with numpy on the host (``host``)."""

from flashtree.speculative.tree.build import build_tree
from flashtree.speculative.tree.draft_tree import (
    NO_PARENT,
    PAD_TOKEN,
    ROOT,
    ROOT_TOKEN,
    DraftTree,
    chain_tree,
    root_only_tree,
)

__all__ = ["DraftTree", "NO_PARENT", "PAD_TOKEN", "ROOT", "ROOT_TOKEN", "build_tree", "chain_tree", "root_only_tree"]
