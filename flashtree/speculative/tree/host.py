"""DDTree's tree built with numpy on the host: the same tree as ``tree.build_tree``'s torch ops.

On a CPU, small trees (the CPU default budget is 4) cost little arithmetic but many small torch
ops: about 60 of them for a DDTree-4 round of SmolLM2. On a 2-core EPYC a 1-row budget-4 build
takes 1.29 ms that way and 0.80 ms here, 0.65 ms of either being the shared top-k. The per-depth top-k
and log-normalizer stay torch ops on the logits (the very same calls, so the same inputs), and
the rest runs as a few numpy ops on arrays of at most ``rows x budget x K`` entries.

Same tree, bit for bit: the rules of ``build.py`` restated on arrays,
- a kept list keeps the best B candidates ordered by (weight as float32 descending, flat index
  ascending), then lists them by flat index (= lexicographic rank order): that is what
  ``_best_flat``'s float32 threshold with ties to the lower index keeps;
- weights add in the log-probabilities' dtype, as the torch ops do;
- the tree takes the best ``max_budget`` of every depth's kept list by the same rule, orders them
  by weight descending (a stable sort in the weights' dtype), marks the first ``budget`` finite
  ones valid and lays out the valid ones by depth (stable), the invalid ones last.

Glossary: as in ``tree.py`` (R rows, L depth, B max budget, K = min(B, V) tokens per depth).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flashtree.speculative.tree.draft_tree import NO_PARENT, PAD_TOKEN, ROOT, ROOT_TOKEN, DraftTree


def build_tree_on_host(top_logp: torch.Tensor, top_tokens: torch.Tensor, budgets: torch.Tensor,
                       max_budget: int, allot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                       ) -> DraftTree:
    """The tree of ``tree.build_tree`` from its per-depth top-K (CPU tensors).

    top_logp: [R, L, K] float log-probabilities, rank order; top_tokens: [R, L, K] int64;
    budgets: [R] int64 in [0, max_budget]; max_budget: B >= 1 (K <= B). allot: as in
    ``tree.build_tree`` (given the ranked weights as a tensor)."""
    logp = top_logp.detach().numpy()  # [R, L, K]
    tokens = top_tokens.detach().numpy()  # [R, L, K]
    weights, parent_pos, level_tokens = _kept_lists(logp, tokens, max_budget)  # [R, L, B] x3
    return _tree(weights, parent_pos, level_tokens, budgets, max_budget, allot)


def _first_best(weights: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` best entries of each row's last axis, ascending: best by float32
    value, ties to the lower index (``tree._best_flat``'s rule). weights: [R, M] -> [R, count]."""
    order = np.argsort(-weights.astype(np.float32), axis=1, kind="stable")  # [R, M]
    return np.sort(order[:, :count], axis=1)


def _kept_lists(logp: np.ndarray, tokens: np.ndarray, max_budget: int) -> tuple[np.ndarray, ...]:
    """Per depth, the best B prefixes in lexicographic rank order: weights [R, L, B] (logp's
    dtype, -inf where none), parent places in the previous list [R, L, B], tokens [R, L, B]."""
    num_rows, depth, k = logp.shape
    weights = np.full((num_rows, depth, max_budget), -np.inf, dtype=logp.dtype)
    parent_pos = np.zeros((num_rows, depth, max_budget), dtype=np.int64)
    kept_tokens = np.zeros((num_rows, depth, max_budget), dtype=np.int64)
    weights[:, 0, :k], kept_tokens[:, 0, :k] = logp[:, 0], tokens[:, 0]  # depth 1: the top-K themselves
    rows = np.arange(num_rows)[:, None]  # [R, 1]
    for d in range(1, depth):
        candidates = (weights[:, d - 1, :, None] + logp[:, d, None, :]).reshape(num_rows, -1)  # [R, B*K]
        flat = _first_best(candidates, max_budget)  # [R, B]
        weights[:, d] = candidates[rows, flat]
        parent_pos[:, d] = flat // k
        kept_tokens[:, d] = tokens[:, d][rows, flat % k]
    return weights, parent_pos, kept_tokens


def _tree(weights: np.ndarray, parent_pos: np.ndarray, level_tokens: np.ndarray, budgets: torch.Tensor,
          max_budget: int, allot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> DraftTree:
    """The best ``budgets[r]`` prefixes over all kept lists (``allot``: see ``build_tree_on_host``), laid out as
    a DraftTree."""
    num_rows, depth, _ = weights.shape
    rows = np.arange(num_rows)[:, None]  # [R, 1]
    all_w = weights.reshape(num_rows, -1)  # [R, L*B]; (depth, lex) order
    chosen = _first_best(all_w, max_budget)  # [R, B]
    ranked = np.take_along_axis(chosen, np.argsort(-all_w[rows, chosen], axis=1, kind="stable"), axis=1)  # [R, B]
    ranked_w = all_w[rows, ranked]  # [R, B]
    if allot is not None:
        budgets = allot(torch.from_numpy(ranked_w), budgets)  # [R]
    budgets = budgets.numpy()  # [R]
    valid = (np.arange(max_budget)[None, :] < budgets[:, None]) & (ranked_w > -np.inf)  # [R, B]
    node_depth = ranked // max_budget + 1  # [R, B]
    layout = np.argsort(np.where(valid, node_depth, depth + 1), axis=1, kind="stable")  # [R, B]
    node_flat = np.take_along_axis(ranked, layout, axis=1)  # [R, B]
    valid = np.take_along_axis(valid, layout, axis=1)
    node_depth = np.take_along_axis(node_depth, layout, axis=1)
    flat_to_node = np.zeros((num_rows, depth * max_budget), dtype=np.int64)  # [R, L*B]
    flat_to_node[rows, node_flat] = np.arange(1, max_budget + 1)
    parent_flat = np.maximum((node_depth - 2) * max_budget + parent_pos.reshape(num_rows, -1)[rows, node_flat], 0)
    parents = np.where(node_depth == 1, ROOT, flat_to_node[rows, parent_flat])  # [R, B]
    root = np.zeros((num_rows, 1), dtype=np.int64)  # [R, 1]
    out_parents = np.concatenate([root + NO_PARENT, np.where(valid, parents, ROOT)], axis=1)  # [R, B+1]
    out_valid = np.concatenate([root == 0, valid], axis=1)  # [R, B+1]
    return DraftTree(
        tokens=torch.from_numpy(np.concatenate(
            [root + ROOT_TOKEN, np.where(valid, level_tokens.reshape(num_rows, -1)[rows, node_flat], PAD_TOKEN)], axis=1)),
        parents=torch.from_numpy(out_parents),
        depths=torch.from_numpy(np.concatenate([root, np.where(valid, node_depth, 0)], axis=1)),
        valid=torch.from_numpy(out_valid),
        ancestor_mask=torch.from_numpy(_ancestor_mask(out_parents, out_valid, depth)),
        log_weights=torch.from_numpy(np.concatenate(
            [np.zeros((num_rows, 1), dtype=all_w.dtype), np.where(valid, all_w[rows, node_flat], -np.inf)], axis=1)),
    )


def _ancestor_mask(parents: np.ndarray, valid: np.ndarray, max_depth: int) -> np.ndarray:
    """[R, N, N] bool: [r, i, j] = j is i or an ancestor of i; the root and invalid nodes see only
    themselves. parents, valid: [R, N]; parents come before their children on the node axis."""
    num_rows, size = parents.shape
    mask = np.broadcast_to(np.eye(size, dtype=bool), (num_rows, size, size)).copy()  # [R, N, N]
    rows, nodes = np.nonzero(valid[:, 1:])
    nodes = nodes + 1
    for _ in range(max_depth):  # each pass copies one more generation of ancestors down
        mask[rows, nodes] |= mask[rows, parents[rows, nodes]]
    return mask
