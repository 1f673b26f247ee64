"""Tree verification through the KV cache: masks, positions and the DDTree commit."""

import torch

from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.speculative.tree import DraftTree
from tests.helpers import make_cache, ours_from_hf, tiny_hf_model

# node: 0 root, 1..7 ; parents in [root, nodes] indexing
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]


def tree_tensors():
    depth, ancestors = [], []
    for i, p in enumerate(PARENTS):
        depth.append(0 if p < 0 else depth[p] + 1)
        ancestors.append({i} | (ancestors[p] if p >= 0 else set()))
    mask = torch.tensor([[j in ancestors[i] for j in range(len(PARENTS))] for i in range(len(PARENTS))])
    return torch.tensor(depth), mask, ancestors


def prefill(model, cache, slot, ids):
    n = len(ids)
    batch = ForwardBatch(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([slot]), torch.tensor([0]),
                         causal_mask(torch.tensor([n]), n), kv_len=n)
    model(batch, cache)
    cache.advance(torch.tensor([slot]), torch.tensor([n]))


def plain_logits(model, ids):
    cache = make_cache(model)
    n = len(ids)
    batch = ForwardBatch(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]), torch.tensor([0]),
                         causal_mask(torch.tensor([n]), n), kv_len=n)
    return model(batch, cache).logits[0]


def path_to(node, ancestors):
    return sorted(ancestors[node], key=lambda j: len([a for a in ancestors[j]]))


def test_tree_forward_equals_path_forward_and_commit_equals_recompute():
    model = ours_from_hf(tiny_hf_model("qwen3_qknorm"))
    prompt = [5, 6, 7, 8, 9]
    depth, mask, ancestors = tree_tensors()
    cache = make_cache(model)
    slot = 1
    prefill(model, cache, slot, prompt)
    start = len(prompt)
    batch = ForwardBatch(torch.tensor([TOKENS]), (start + depth)[None], torch.tensor([slot]),
                         torch.tensor([start]), mask[None], kv_len=start + len(TOKENS))
    tree_logits = model(batch, cache).logits[0]
    for node in range(len(TOKENS)):
        path_ids = [TOKENS[j] for j in path_to(node, ancestors)]
        ref = plain_logits(model, prompt + path_ids)[-1]
        assert (tree_logits[node] - ref).abs().max().item() < 1e-4, node

    # commit the path root -> 2 -> 5 -> 7, then decode one more token; compare with a fresh prefill
    keep = torch.tensor([[0, 2, 5, 7]])
    cache.commit(torch.tensor([slot]), torch.tensor([start]), keep, torch.tensor([4]))
    assert cache.lengths[slot].item() == start + 4
    committed = prompt + [TOKENS[i] for i in (0, 2, 5, 7)]
    nxt = 42
    step = ForwardBatch(torch.tensor([[nxt]]), torch.tensor([[len(committed)]]), torch.tensor([slot]),
                        torch.tensor([len(committed)]), torch.ones(1, 1, 1, dtype=torch.bool),
                        kv_len=len(committed) + 1)
    after_commit = model(step, cache).logits[0, 0]
    ref = plain_logits(model, committed + [nxt])[-1]
    assert (after_commit - ref).abs().max().item() < 1e-4


def test_partial_commit_keeps_other_slots_intact():
    model = ours_from_hf(tiny_hf_model("llama_gqa"))
    cache = make_cache(model)
    prefill(model, cache, 0, [1, 2, 3])
    prefill(model, cache, 2, [4, 5, 6, 7])
    before = cache.k[0][0, :, :3].clone()
    depth, mask, _ = tree_tensors()
    start = 4
    batch = ForwardBatch(torch.tensor([TOKENS]), (start + depth)[None], torch.tensor([2]),
                         torch.tensor([start]), mask[None], kv_len=start + len(TOKENS))
    model(batch, cache)
    cache.commit(torch.tensor([2]), torch.tensor([4]), torch.tensor([[0, 1, 3, -1]]), torch.tensor([3]))
    assert torch.equal(cache.k[0][0, :, :3], before)
    assert cache.lengths.tolist()[:3] == [3, 0, 7]
