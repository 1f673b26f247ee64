"""Per-row budgets in the DDTree build and the accept walk: a round's rule (``allot``) sees each row's
ranked path weights and the tree keeps its best ``budgets[b]`` nodes, exactly the tree built with
those budgets; the unused node slots are padding that sees only itself and is never accepted."""

from __future__ import annotations

import pytest
import torch

from flashtree.policy.row_budgets import allot_budgets
from flashtree.speculative.tree import PAD_TOKEN, ROOT, DraftTree, build_tree
from flashtree.speculative.tree.draft_tree import narrowed
from flashtree.speculative.verify import accept_walk
from tests.support.kernel_checks import walk_choices


def random_logits(seed: int, rows: int, depth: int, vocab: int, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, depth, vocab, generator=gen) * 2.0
    return (logits * 2).round() / 2 if ties else logits


def assert_same_trees(got: DraftTree, want: DraftTree) -> None:
    for name, a, b in zip(DraftTree._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


class Recorder:
    """An allot rule that returns fixed budgets and keeps what it was shown."""

    def __init__(self, budgets: list[int]):
        self.budgets, self.seen = torch.tensor(budgets), []

    def __call__(self, ranked: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
        self.seen.append((ranked.clone(), caps.clone()))
        return torch.minimum(self.budgets, caps)


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("ties", [False, True])
def test_allotted_tree_is_the_tree_of_the_allotted_budgets(host, ties):
    max_budget = 12
    logits = random_logits(3, 5, 4, 30, ties)
    caps = torch.tensor([12, 12, 12, 5, 0])
    rule = Recorder([0, 1, 12, 7, 3])
    got = build_tree(logits, caps, max_budget, host=host, allot=rule)
    assert_same_trees(got, build_tree(logits, torch.tensor([0, 1, 12, 5, 0]), max_budget, host=host))
    ranked, seen_caps = rule.seen[0]
    assert torch.equal(seen_caps, caps)
    # the rule sees each row's best max_budget path log-weights, descending: the full tree's weights
    full = build_tree(logits, max_budget, max_budget, host=host)
    want = torch.sort(full.log_weights[:, 1:], dim=1, descending=True).values
    assert torch.equal(ranked, want)


def test_host_and_torch_paths_give_the_rule_the_same_weights():
    logits = random_logits(5, 3, 6, 40)
    seen = []
    for host in (True, False):
        rule = Recorder([2, 9, 0])
        build_tree(logits, 9, 9, host=host, allot=rule)
        seen.append(rule.seen[0][0])
    assert torch.equal(*seen)


def test_padding_nodes_see_only_themselves_and_are_never_accepted():
    max_budget = 8
    logits = random_logits(7, 3, 3, 20)
    tree = build_tree(logits, torch.tensor([0, 1, 8]), max_budget, allot=Recorder([0, 1, 8]))
    assert tree.valid.sum(1).tolist() == [1, 2, 9]
    pad = ~tree.valid
    assert (tree.tokens[pad] == PAD_TOKEN).all() and (tree.parents[pad] == ROOT).all()
    assert (tree.depths[pad] == 0).all() and (tree.log_weights[pad] == float("-inf")).all()
    eye = torch.eye(max_budget + 1, dtype=torch.bool).expand(3, -1, -1)
    assert torch.equal(tree.ancestor_mask[pad], eye[pad])  # a padded node sees only itself
    # the target's choice at every node is the padding token: no padded node is ever walked into
    choice = torch.full_like(tree.tokens, PAD_TOKEN)
    walk = accept_walk(tree._replace(tokens=tree.tokens.clamp(min=0)), choice, 3)
    for b in range(3):
        on_path = walk.path[b][walk.path[b] >= 0]
        assert tree.valid[b, on_path].all()
    # a row walks its own valid nodes only: follow row 2's deepest node
    deepest = int(tree.depths[2].argmax())
    path, node = [], deepest
    while node != ROOT:
        path.append(node)
        node = int(tree.parents[2, node])
    choice = torch.full_like(tree.tokens, 10**6)
    for child in path:
        choice[2, tree.parents[2, child]] = tree.tokens[2, child]
    walk = accept_walk(tree, choice, 3)
    assert walk.accept_lengths.tolist() == [1, 1, len(path) + 1]


def test_valid_nodes_come_first_so_a_narrowed_tree_is_the_same_tree():
    logits = random_logits(9, 4, 5, 25)
    tree = build_tree(logits, 16, 16, allot=Recorder([3, 0, 6, 1]))
    width = int(tree.valid.sum(1).max())
    assert width == 7 and not tree.valid[:, width:].any()
    small = narrowed(tree, width)
    assert small.tokens.shape == (4, 7) and small.ancestor_mask.shape == (4, 7, 7)
    for seed in range(4):  # choices that follow a random child 3 times in 4: walks go deep
        choice = walk_choices(tree, seed)
        full_walk, small_walk = accept_walk(tree, choice, 5), accept_walk(small, choice[:, :width], 5)
        for a, b in zip(full_walk, small_walk):
            assert torch.equal(a, b)


def test_the_policy_rule_in_the_build():
    """The policy's allotment as the rule: a confident row keeps more nodes than an unconfident one."""
    confident = torch.full((1, 3, 10), -10.0)
    confident[0, :, 2] = 5.0  # one token per depth holds almost all the mass
    unsure = torch.zeros(1, 3, 10)  # uniform: every prefix is unlikely
    logits = torch.cat([confident, unsure])
    cost = 1.0 + 0.05 * torch.arange(2 * 9 + 1, dtype=torch.float32)
    live = torch.tensor([True, True])
    tree = build_tree(logits, 8, 8, allot=lambda ranked, caps: allot_budgets(ranked, caps, cost, live))
    sizes = (tree.valid.sum(1) - 1).tolist()
    assert sizes[0] >= 3 and sizes[1] == 0, sizes
