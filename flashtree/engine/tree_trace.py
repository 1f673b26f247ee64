"""Tree traces (``--trace-trees FILE``): one JSON line per request per round with the verified
tree (node tokens and parents, root first) and the accepted path (node indices, root first).

Tracing copies each round's tree to the host, so it runs rounds eagerly (no CUDA graphs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from flashtree.engine.json_lines import JsonLines
from flashtree.engine.request import Request
from flashtree.speculative.tree.build import DraftTree


class TreeTracer:
    def __init__(self, path: str | Path):
        self.out = JsonLines(path)  # a round's lines at once
        self.pending: tuple[torch.Tensor, ...] | None = None

    def hold(self, tree: DraftTree, tokens: torch.Tensor, path: torch.Tensor) -> None:
        """Keep the round's device tensors until the round's host sync (no extra sync here)."""
        self.pending = (tokens, tree.parents, tree.valid, path)

    def write(self, rows: Sequence[Request]) -> None:
        if self.pending is None:
            return
        tokens, parents, valid, path = (t.tolist() for t in self.pending)
        self.pending = None
        lines = []
        for b, req in enumerate(rows):
            count = sum(valid[b])  # valid nodes are a leading run: root, then drafted nodes
            lines.append({"request_id": req.request_id, "round": req.stats.rounds, "tokens": tokens[b][:count],
                          "parents": parents[b][:count], "accepted_path": [n for n in path[b] if n >= 0]})
        self.out.write(*lines)

    def close(self) -> None:
        self.out.close()
