"""Grammar-constrained draft trees (flashtree/grammar/tree.py) against brute force: the tree holds
exactly the best ``budget`` prefixes the grammar allows, each node's mask is the grammar's after its
path, a chain takes the best allowed token per depth, and the matcher ends where it started."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flashtree.grammar.backends import bitmask_words
from flashtree.grammar.tree import allowed_tokens, grammar_tree

VOCAB = 40


class RuleMatcher:
    """A toy grammar over token ids: after token t only tokens in ``follows(t)`` may come; token
    STOP ends it. Counts its calls, so tests can see the root state restored."""

    STOP = 39

    def __init__(self, history=(7,)):
        self.history = list(history)

    @staticmethod
    def follows(token: int) -> set[int]:
        return {t for t in range(VOCAB) if (t + token) % 3 != 0 or t == RuleMatcher.STOP}

    def accept(self, token: int) -> bool:
        if self.terminated or token not in self.follows(self.history[-1]):
            return False
        self.history.append(token)
        return True

    def rollback(self, count: int) -> None:
        del self.history[len(self.history) - count:]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = torch.zeros(bitmask_words(VOCAB) * 32, dtype=torch.bool)
        allowed[sorted(self.follows(self.history[-1]))] = True
        bitmask[row] = _pack(allowed)

    @property
    def terminated(self) -> bool:
        return self.history[-1] == self.STOP


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """``[32 W]`` bool -> ``[W]`` int32 words (bit 31 wraps to the sign)."""
    words = (allowed.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)  # [W] in [0, 2**32)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _candidates(depth: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per depth, k distinct tokens with distinct log-probabilities, best first."""
    rng = np.random.default_rng(seed)
    tokens = np.stack([rng.choice(VOCAB, size=k, replace=False) for _ in range(depth)])  # [L, K]
    log_probs = -np.sort(rng.exponential(2.0, size=(depth, k)), axis=1)  # [L, K] descending
    return log_probs.astype(np.float32), tokens.astype(np.int64)


def _allowed_prefixes(root: int, log_probs, tokens) -> dict[tuple[int, ...], float]:
    """Every prefix of the candidates the rules allow after ``root``, with its weight."""
    depth, k = tokens.shape
    found = {}
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=length):
            path = [int(tokens[d, r]) for d, r in enumerate(ranks)]
            previous = [root] + path[:-1]
            if any(prev == RuleMatcher.STOP or t not in RuleMatcher.follows(prev) for prev, t in zip(previous, path)):
                continue
            found[tuple(path)] = float(sum(np.float32(log_probs[d, r]) for d, r in enumerate(ranks)))
    return found


def _paths(tree) -> list[tuple[int, ...]]:
    paths = []
    for node in range(1, int(tree.valid.sum())):
        path, at = [], node
        while at > 0:
            path.append(int(tree.tokens[at]))
            at = int(tree.parents[at])
        paths.append(tuple(path[::-1]))
    return paths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 5, 12])
def test_tree_is_the_best_allowed_prefixes(seed, budget):
    log_probs, tokens = _candidates(depth=3, k=5, seed=seed)
    matcher = RuleMatcher()
    words = bitmask_words(VOCAB)
    tree = grammar_tree(matcher, log_probs, tokens, budget, size=16, words=words)
    assert matcher.history == [7]  # back at the root's state
    every = _allowed_prefixes(7, log_probs, tokens)
    best = sorted(every, key=lambda p: -every[p])[:budget]
    assert sorted(_paths(tree)) == sorted(best)
    count = int(tree.valid.sum())
    assert tree.valid[:count].all() and not tree.valid[count:].any()
    assert all(tree.parents[i] < i for i in range(1, count))  # parents first
    allowed = allowed_tokens(torch.from_numpy(tree.bitmask), VOCAB)  # [N, V]
    for node, path in zip(range(1, count), _paths(tree)):
        assert set(torch.nonzero(allowed[node]).flatten().tolist()) == RuleMatcher.follows(path[-1])
        assert tree.depths[node] == len(path)
        assert tree.log_weights[node] == pytest.approx(every[path], abs=1e-5)
    assert set(torch.nonzero(allowed[0]).flatten().tolist()) == RuleMatcher.follows(7)


@pytest.mark.parametrize("seed", range(6))
def test_chain_takes_the_best_allowed_token_per_depth(seed):
    log_probs, tokens = _candidates(depth=4, k=6, seed=seed)
    tree = grammar_tree(RuleMatcher(), log_probs, tokens, budget=4, size=5, words=bitmask_words(VOCAB), chain=True)
    previous, expected = 7, []
    for d in range(4):
        if previous == RuleMatcher.STOP:
            break
        allowed = [int(t) for t in tokens[d] if int(t) in RuleMatcher.follows(previous)]
        if not allowed:
            break
        expected.append(allowed[0])
        previous = allowed[0]
    count = int(tree.valid.sum()) - 1
    assert tree.tokens[1:1 + count].tolist() == expected
    assert tree.parents[1:1 + count].tolist() == list(range(count))  # a chain: node i after node i - 1


def test_nothing_follows_a_terminated_node():
    tokens = np.array([[RuleMatcher.STOP, 1], [2, 4]], dtype=np.int64)
    log_probs = np.array([[-0.1, -3.0], [-0.1, -0.2]], dtype=np.float32)
    tree = grammar_tree(RuleMatcher(history=(1,)), log_probs, tokens, budget=8, size=9, words=bitmask_words(VOCAB))
    paths = _paths(tree)
    assert (RuleMatcher.STOP,) in paths
    assert not any(len(p) > 1 and p[0] == RuleMatcher.STOP for p in paths)
    stop_node = 1 + paths.index((RuleMatcher.STOP,))
    assert (tree.bitmask[stop_node] == -1).all()  # all allowed: what is chosen after a stop is dropped


def test_allowed_tokens_unpacks_bit_t_of_word_t_over_32():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[1, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    allowed = allowed_tokens(bitmask, 64)
    assert torch.nonzero(allowed).tolist() == [[0, 5], [1, 63]]
