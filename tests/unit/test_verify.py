"""Accept walk: hand-made trees, a plain-Python walk oracle, and the DFlash chain rule."""

from __future__ import annotations

import random

import pytest
import torch

from flashtree.speculative.tree import DraftTree, build_tree, chain_tree
from flashtree.speculative.verify import AcceptResult, accept_walk


def make_tree(tokens: list[int], parents: list[int], valid: list[bool] | None = None) -> DraftTree:
    """A one-row DraftTree from node lists (index 0 = root); mask by walking parents."""
    size = len(tokens)
    valid = valid if valid is not None else [True] * size
    depths, mask = [0] * size, torch.zeros(1, size, size, dtype=torch.bool)
    for node in range(size):
        mask[0, node, node] = True
        walk = node
        while valid[node] and walk > 0:
            walk = parents[walk]
            mask[0, node, walk] = True
            depths[node] += 1
    return DraftTree(
        tokens=torch.tensor([tokens]),
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
        valid=torch.tensor([valid]),
        ancestor_mask=mask,
        log_weights=torch.zeros(1, size),
    )


def walk_oracle(tree: DraftTree, choice: torch.Tensor, row: int) -> list[int]:
    """Plain-Python walk: the accepted path of one row, root first."""
    tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
    valid, choice_row = tree.valid[row].tolist(), choice[row].tolist()
    path = [0]
    while True:
        y = choice_row[path[-1]]
        kids = [n for n in range(1, len(tokens)) if valid[n] and parents[n] == path[-1] and tokens[n] == y]
        assert len(kids) <= 1
        if not kids:
            return path
        path.append(kids[0])


def check_result(result: AcceptResult, tree: DraftTree, choice: torch.Tensor, row: int) -> None:
    path = walk_oracle(tree, choice, row)
    width = result.path.shape[1]
    assert result.path[row].tolist() == path + [-1] * (width - len(path))
    assert result.accept_lengths[row].item() == len(path)
    assert result.next_bonus[row].item() == choice[row, path[-1]].item()
    committed = [tree.tokens[row, n].item() for n in path]
    assert result.committed_tokens[row].tolist() == committed + [-1] * (width - len(path))


# ---------------------------------------------------------------- hand-made trees

#        root(bonus 99)
#        /      |      \
#     1:a=10  2:b=11  3:c=12
#      /   \      \
#  4:d=20 5:e=21  6:f=22
#     |
#  7:g=30
HAND = make_tree(tokens=[99, 10, 11, 12, 20, 21, 22, 30], parents=[-1, 0, 0, 0, 1, 1, 2, 4])


@pytest.mark.parametrize(
    "choice, path, bonus",
    [
        ({0: 10, 1: 20, 4: 30, 7: 77}, [0, 1, 4, 7], 77),  # full depth, bonus after the leaf
        ({0: 10, 1: 21, 5: 5}, [0, 1, 5], 5),
        ({0: 11, 2: 23}, [0, 2], 23),  # 23 is not a child of node 2
        ({0: 13}, [0], 13),  # reject at the root: commit only the bonus
        ({0: 12, 3: 20}, [0, 3], 20),  # 20 is a token elsewhere, but not under node 3
    ],
)
def test_hand_made_tree(choice: dict[int, int], path: list[int], bonus: int) -> None:
    target = torch.full((1, 8), -5)
    for node, y in choice.items():
        target[0, node] = y
    result = accept_walk(HAND, target, max_depth=3)
    assert result.path[0].tolist() == path + [-1] * (4 - len(path))
    assert result.accept_lengths.tolist() == [len(path)]
    assert result.next_bonus.tolist() == [bonus]
    tokens = HAND.tokens[0].tolist()
    assert result.committed_tokens[0].tolist() == [tokens[n] for n in path] + [-1] * (4 - len(path))


def test_invalid_nodes_are_never_walked_into() -> None:
    # Node 2 carries the target's choice but is invalid; node 3 is an invalid child of node 1.
    tree = make_tree(tokens=[99, 10, 7, 8], parents=[-1, 0, 0, 1], valid=[True, True, False, False])
    result = accept_walk(tree, torch.tensor([[7, 8, 0, 0]]), max_depth=2)
    assert result.path.tolist() == [[0, -1, -1]] and result.next_bonus.tolist() == [7]
    result = accept_walk(tree, torch.tensor([[10, 8, 0, 0]]), max_depth=2)
    assert result.path.tolist() == [[0, 1, -1]] and result.next_bonus.tolist() == [8]


def test_padded_nodes_of_built_tree_are_not_walked() -> None:
    logits = torch.tensor([[[-10.0, 1.0, 2.0], [-10.0, 1.0, 2.0]]], dtype=torch.float64)
    tree = build_tree(logits, 2, 10)  # token 0 is never drafted; nodes 3..10 are padding
    assert tree.valid[0].tolist() == [True] * 3 + [False] * 8
    assert tree.tokens[0, 3:].eq(0).all() and tree.parents[0, 3:].eq(0).all()
    target = torch.zeros(1, 11, dtype=torch.long)  # the target wants the padding token
    result = accept_walk(tree, target, max_depth=2)
    assert result.path.tolist() == [[0, -1, -1]] and result.next_bonus.tolist() == [0]


# ---------------------------------------------------------------- random trees vs oracle


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_match_oracle(seed: int) -> None:
    rows, depth, vocab, max_budget = 8, 6, 8, 40
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, depth, vocab, generator=generator, dtype=torch.float64) * 2
    budgets = torch.randint(0, max_budget + 1, (rows,), generator=generator)
    tree = build_tree(logits, budgets, max_budget)
    tree = tree._replace(tokens=tree.tokens.clone())
    tree.tokens[:, 0] = torch.arange(rows) + 1000  # the engine writes the bonus into the root
    # Target choices that often follow a valid child, so paths get deep.
    rng = random.Random(seed)
    choice = torch.randint(0, vocab, (rows, max_budget + 1), generator=generator)
    for r in range(rows):
        for node in range(max_budget + 1):
            kids = [k for k in range(1, max_budget + 1)
                    if tree.valid[r, k] and tree.parents[r, k] == node]
            if kids and rng.random() < 0.8:
                choice[r, node] = tree.tokens[r, rng.choice(kids)]
    result = accept_walk(tree, choice, max_depth=depth)
    default = accept_walk(tree, choice)  # max_depth = N - 1: same walk, longer padding
    for r in range(rows):
        check_result(result, tree, choice, r)
        check_result(default, tree, choice, r)
    assert result.accept_lengths.max().item() > 2


# ---------------------------------------------------------------- DFlash chain


def dflash_rule(draft: list[int], y: list[int]) -> tuple[int, int]:
    """Accept d_i while d_i == y_{i-1}; returns (accepted drafts k, next bonus y_k)."""
    k = 0
    while k < len(draft) and draft[k] == y[k]:
        k += 1
    return k, y[k]


@pytest.mark.parametrize("seed", range(4))
def test_chain_matches_dflash_rule(seed: int) -> None:
    rows, depth, vocab = 16, 15, 3
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, vocab, (rows, depth), generator=generator)
    # y_i equals d_{i+1} mostly, so acceptance lengths spread over 0..L.
    y = torch.cat([draft, torch.randint(0, vocab, (rows, 1), generator=generator)], dim=1)
    flip = torch.rand(rows, depth + 1, generator=generator) < 0.15
    y = torch.where(flip, torch.randint(0, vocab, (rows, depth + 1), generator=generator), y)
    tree = chain_tree(draft)
    tree = tree._replace(tokens=tree.tokens.clone())
    bonus = torch.arange(rows) + 500
    tree.tokens[:, 0] = bonus
    result = accept_walk(tree, y, max_depth=depth)
    for r in range(rows):
        k, next_bonus = dflash_rule(draft[r].tolist(), y[r].tolist())
        assert result.accept_lengths[r].item() == k + 1
        assert result.next_bonus[r].item() == next_bonus
        committed = [bonus[r].item()] + draft[r, :k].tolist()
        assert result.committed_tokens[r].tolist() == committed + [-1] * (depth - k)
        assert result.path[r].tolist() == list(range(k + 1)) + [-1] * (depth - k)


def test_no_host_sync_on_meta_device() -> None:
    tree = build_tree(torch.empty(3, 15, 1000, device="meta"), 64, 64)
    result = accept_walk(tree, torch.empty(3, 65, dtype=torch.long, device="meta"), max_depth=15)
    assert result.path.shape == (3, 16) and result.accept_lengths.shape == (3,)
    assert all(t.device.type == "meta" for t in result)
