"""The grammar rows of one round or prefill: their token masks and their constrained trees.

A request with structured output holds a grammar matcher (``flashtree/grammar/``) that has accepted
every output token so far, the bonus token included. A round with such a row runs eagerly (no CUDA
graph, and nothing queued behind it): after the drafter proposes, the host rebuilds each grammar
row's tree from the drafter's candidates under the grammar (:meth:`GrammarRound.refine`), and the
target's logits at every node are masked with what the grammar allows after that node's path
(:attr:`GrammarRound.allowed`). Rows without a grammar keep their trees and every token.

Glossary: B rows (the real ones, then pad rows), N entries on the node axis, V the target's
vocabulary, W int32 words per token bitmask.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from flashtree.device_copy import to_device
from flashtree.engine.request import Request
from flashtree.grammar.backends import bitmask_words
from flashtree.grammar.tree import (
    ALL_ALLOWED,
    allowed_tokens,
    grammar_tree,
    root_bitmask,
)
from flashtree.speculative.proposer import DraftCandidates
from flashtree.speculative.tree.build import ancestor_mask
from flashtree.speculative.tree.draft_tree import DraftTree

log = logging.getLogger(__name__)


class GrammarRound:
    def __init__(self, rows: Sequence[Request], width: int, vocab: int, device: torch.device, nodes: int = 0,
                 chain: bool = False, max_depth: int = 0):
        """``rows``: the real rows (``width`` with the pad rows); ``nodes``: the round's drafted nodes
        per row, ``chain``: the proposer drafts chains, ``max_depth``: its deepest node."""
        self.rows, self.width, self.vocab, self.device = list(rows), width, vocab, device
        self.words = bitmask_words(vocab)
        self.nodes, self.chain, self.max_depth = nodes, chain, max_depth
        self._allowed: torch.Tensor | None = None  # [B, N, V] once refine has run

    @staticmethod
    def needed(rows: Sequence[Request]) -> bool:
        return any(r.grammar is not None and not r.finished for r in rows)

    @property
    def allowed(self) -> torch.Tensor:
        """``[B, N, V]`` bool: the tokens each node may be followed by (N = 1 before a refine: the roots)."""
        if self._allowed is None:
            self._allowed = self.root_allowed()
        return self._allowed

    def root_allowed(self) -> torch.Tensor:
        """``[B, 1, V]`` bool: the tokens allowed next at each row's grammar state."""
        bitmask = np.full((self.width, 1, self.words), ALL_ALLOWED, dtype=np.int32)  # [B, 1, W]
        for b, req in enumerate(self.rows):
            if req.grammar is not None and not req.finished:
                bitmask[b, 0] = root_bitmask(req.grammar, self.words)
        return self._to_allowed(bitmask)

    def refine(self, tree: DraftTree, candidates: DraftCandidates) -> DraftTree:
        """The round's trees with each grammar row's rebuilt from the drafter's candidates; sets
        :attr:`allowed` for every node (a host sync: the trees and candidates are read)."""
        host = DraftTree(*(t.cpu() for t in tree))
        log_probs, tokens = candidates.log_probs.cpu().numpy(), candidates.tokens.cpu().numpy()  # [B, L, K]
        size = host.tokens.shape[1]
        bitmask = np.full((self.width, size, self.words), ALL_ALLOWED, dtype=np.int32)  # [B, N, W]
        arrays = {name: getattr(host, name).numpy().copy() for name in ("tokens", "parents", "depths", "valid",
                                                                         "log_weights")}
        for b, req in enumerate(self.rows):
            if req.grammar is None or req.finished:
                continue
            budget = self.nodes if self.chain or req.budget is None else min(req.budget, self.nodes)
            row = grammar_tree(req.grammar, log_probs[b], tokens[b], budget, size, self.words, chain=self.chain)
            for name, values in arrays.items():
                values[b] = getattr(row, name)
            bitmask[b] = row.bitmask
        parents, valid = torch.from_numpy(arrays["parents"]), torch.from_numpy(arrays["valid"])
        rebuilt = DraftTree(tokens=torch.from_numpy(arrays["tokens"]), parents=parents,
                            depths=torch.from_numpy(arrays["depths"]), valid=valid,
                            ancestor_mask=ancestor_mask(parents, valid, self.max_depth),
                            log_weights=torch.from_numpy(arrays["log_weights"]).to(tree.log_weights.dtype))
        self._allowed = self._to_allowed(bitmask)
        return DraftTree(*(to_device(t, self.device) for t in rebuilt))

    def _to_allowed(self, bitmask: np.ndarray) -> torch.Tensor:
        return allowed_tokens(to_device(torch.from_numpy(bitmask), self.device), self.vocab)


def advance_grammar(req: Request, tokens: Sequence[int]) -> list[int]:
    """The request's matcher accepts its newly emitted tokens; returns those it accepted, up to the one that
    terminated the grammar (a stop token it ends with): the output is complete there, and the request ends
    with it even where that token is not one of the request's stop tokens (``ignore_eos``). Each token was
    chosen under its mask, so all are accepted, unless every token was masked (min_tokens forbidding the stop
    tokens the grammar needs): then the rest is dropped and logged."""
    matcher = req.grammar
    if matcher is None:
        return list(tokens)
    for i, token in enumerate(tokens):
        if matcher.terminated:
            return list(tokens[:i])
        if not matcher.accept(token):
            log.error("request %s: its grammar refused token %d (every token masked?); the request ends here",
                      req.request_id, token)
            return list(tokens[:i])
    return list(tokens)
