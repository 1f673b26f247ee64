"""The ragged layout (models/packing.py): rows packed into a flat token batch, and a packed target forward
that gives the padded forward's logits and hidden states at every packed entry (torch ops, the C++ kernels,
the row-invariant float32 products) and writes the same K/V there."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels.cpu.library import KernelUnavailable, load_kernels
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.build import build_model
from flashtree.models.config import ModelConfig
from flashtree.models.packing import pack_rows


def test_rows_pack_in_order_and_the_dump_takes_the_rest():
    packing = pack_rows(torch.tensor([2, 0, 3]), width=4, total=6)
    assert packing.total == 6
    assert packing.flat_of.tolist() == [[0, 1, 6, 6], [6, 6, 6, 6], [2, 3, 4, 6]]
    assert packing.padded_of.tolist() == [0, 1, 8, 9, 10, 12]  # the last flat token is a pad: the dump (3 x 4)
    assert packing.row_of.tolist() == [0, 0, 2, 2, 2, 2]
    assert packing.counts.tolist() == [2, 0, 3]


def test_tokens_past_the_total_stay_unpacked():
    packing = pack_rows(torch.tensor([3, 3]), width=3, total=4)
    assert packing.flat_of.tolist() == [[0, 1, 2], [3, 4, 4]]
    assert packing.packed.tolist() == [[True, True, True], [True, False, False]]
    assert packing.padded_of.tolist() == [0, 1, 2, 3]
    assert packing.counts.tolist() == [3, 1]


def test_gather_then_scatter_keeps_the_packed_entries():
    packing = pack_rows(torch.tensor([1, 3]), width=3, total=5)
    padded = torch.arange(1, 7, dtype=torch.float32).view(2, 3, 1)  # [B, N, 1]
    flat = packing.gather(padded)  # [T, 1]
    assert flat[:, 0].tolist() == [1, 4, 5, 6, 6]  # (the pad token reads the last entry)
    back = packing.scatter(flat, 2, 3)
    assert back[..., 0].tolist() == [[1, 6, 6], [4, 5, 6]]  # (unpacked entries: the last flat token's values)
    assert packing.at(flat, torch.tensor([[0, 0], [2, 1]]))[..., 0].tolist() == [[1, 1], [6, 5]]


@pytest.mark.parametrize("bad", [dict(counts=torch.zeros(2, 2), width=2, total=2),
                                 dict(counts=torch.ones(2), width=0, total=2),
                                 dict(counts=torch.ones(2), width=2, total=0)])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError, match="counts|width"):
        pack_rows(bad["counts"].long(), bad["width"], bad["total"])


# ---------------------------------------------------------------------------- the packed forward

CONFIG = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, qk_norm=True)
CAPTURE = (0, 2)


def prefilled_cache(model, lengths: torch.Tensor) -> KVCache:
    """A cache whose rows hold ``lengths`` committed tokens of a causal prompt."""
    cache = KVCache(KVCacheSpec(CONFIG.num_hidden_layers, 4, 32, 8, CONFIG.num_key_value_heads, CONFIG.head_dim),
                    torch.float32, "cpu")
    width = int(lengths.max())
    ids = (torch.arange(lengths.numel() * width).view(-1, width) * 7) % CONFIG.vocab_size
    slots = torch.arange(lengths.numel())
    model(ForwardBatch(ids, torch.arange(width).expand(lengths.numel(), -1), slots, torch.zeros_like(lengths),
                       causal_mask(lengths, width), width, prefill=True), cache, logits_index=(lengths - 1)[:, None])
    cache.advance(slots, lengths)
    return cache


def tree_batch(lengths: torch.Tensor, counts: torch.Tensor) -> ForwardBatch:
    """Rows whose first ``counts`` entries form a small tree (entry i's parent (i - 1) // 2), the rest padding."""
    rows, width = lengths.numel(), 5
    entry = torch.arange(width)
    parent = (entry - 1).clamp(min=0) // 2
    depth = torch.tensor([0, 1, 1, 2, 2])
    ancestors = torch.eye(width, dtype=torch.bool)
    for i in range(1, width):
        ancestors[i] |= ancestors[parent[i]]
    real = entry[None, :] < counts[:, None]  # [B, N]
    mask = torch.where(real[:, :, None], ancestors[None] & real[:, None, :], torch.eye(width, dtype=torch.bool))
    ids = (torch.arange(rows * width).view(rows, width) * 11 + 3) % CONFIG.vocab_size
    return ForwardBatch(ids, lengths[:, None] + depth[None], torch.arange(rows), lengths, mask,
                        int(lengths.max()) + width)


def both_layouts(kernels: str, total: int):
    """(padded output, its K/V, packed output, its K/V, packing) of one tree batch on two equal caches."""
    model = build_model(CONFIG, None, torch.device("cpu"), torch.float32, seed=3)
    if kernels != "torch":
        try:
            load_kernels()
        except KernelUnavailable:
            pytest.skip("the C++ kernel library does not build here")
        assert model.use_cpu_kernels(True)
        if kernels == "held":
            assert model.hold_float32_products(True)
    lengths, counts = torch.tensor([6, 3, 9, 4]), torch.tensor([5, 1, 0, 3])
    batch = tree_batch(lengths, counts)
    outputs = []
    for packing in (None, pack_rows(counts, batch.num_new, total)):
        cache = prefilled_cache(model, lengths)
        out = model(batch._replace(packing=packing), cache, capture_layers=CAPTURE)
        outputs.append((out, cache))
    return outputs, pack_rows(counts, batch.num_new, total), batch, lengths


@pytest.mark.parametrize("kernels", ["torch", "cpp", "held"])
def test_packed_forward_gives_the_padded_forward_at_packed_entries(kernels):
    [(padded, padded_cache), (packed, packed_cache)], packing, batch, lengths = both_layouts(kernels, total=11)
    assert packed.logits.shape == (1, 11, CONFIG.vocab_size) and packed.hidden.shape == (1, 11, 2 * CONFIG.hidden_size)
    real = packing.padded_of < batch.input_ids.numel()  # [T] flat tokens that are real (9 of 11)
    assert int(real.sum()) == 9
    tolerance = 0.0 if kernels == "held" else 1e-5  # (held products are row-invariant: the same bits)
    for name in ("logits", "hidden"):
        want = packing.gather(getattr(padded, name))[real]
        got = getattr(packed, name)[0][real]
        assert (got - want).abs().max() <= tolerance, name
    assert padded.logits.std() > 0.1
    for layer in range(CONFIG.num_hidden_layers):  # every packed entry's K/V written as the padded forward's
        for row, (start, count) in enumerate(zip(lengths.tolist(), packing.packed.sum(1).tolist())):
            want, _ = padded_cache.view(layer, torch.tensor([row]), start + count)
            got, _ = packed_cache.view(layer, torch.tensor([row]), start + count)
            assert (got - want).abs().max() <= tolerance


def test_a_packed_forward_takes_no_logits_index():
    model = build_model(CONFIG, None, torch.device("cpu"), torch.float32, seed=3)
    lengths, counts = torch.tensor([2, 2]), torch.tensor([2, 2])
    batch = tree_batch(lengths, counts)._replace(packing=pack_rows(counts, 5, 4))
    with pytest.raises(ValueError, match="logits_index"):
        model(batch, prefilled_cache(model, lengths), logits_index=torch.zeros(2, 1, dtype=torch.long))
