"""Our decoder against Hugging Face transformers (used only in tests), fp32, tiny random configs."""

import pytest
import torch

from flashtree.models.batch import ForwardBatch, causal_mask
from tests.helpers import TINY_FAMILIES, make_cache, ours_from_hf, tiny_hf_model


def run_prompt(model, cache, ids, slot=0, capture=()):
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor([ids]), positions=torch.arange(n)[None], slots=torch.tensor([slot]),
        cache_lengths=torch.tensor([0]), new_mask=causal_mask(torch.tensor([n]), n), kv_len=n)
    return model(batch, cache, capture_layers=capture)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_logits_match_transformers(family):
    hf = tiny_hf_model(family)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = run_prompt(ours, make_cache(ours), ids[0].tolist(), capture=(0, 1, 2))
    assert (out.logits - ref.logits).abs().max().item() < 1e-4
    # hidden_states[id + 1]; for the last layer (2) Hugging Face reports it after the final norm
    expected_hidden = torch.cat([ref.hidden_states[1], ref.hidden_states[2], ref.hidden_states[3]], dim=-1)
    assert (out.hidden - expected_hidden).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama_gqa", "qwen3_qknorm", "qwen3_moe"])
def test_incremental_decode_matches_full_forward(family):
    hf = tiny_hf_model(family)
    ours = ours_from_hf(hf)
    cache = make_cache(ours)
    ids = list(range(3, 23))
    run_prompt(ours, cache, ids[:12], slot=2)
    cache.advance(torch.tensor([2]), torch.tensor([12]))
    for t in range(12, 20):
        batch = ForwardBatch(torch.tensor([[ids[t]]]), torch.tensor([[t]]), torch.tensor([2]),
                             torch.tensor([t]), torch.ones(1, 1, 1, dtype=torch.bool), kv_len=t + 1)
        step = ours(batch, cache)
        cache.advance(torch.tensor([2]), torch.tensor([1]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:20]])).logits[0, -1]
    assert (step.logits[0, -1] - ref).abs().max().item() < 1e-4
