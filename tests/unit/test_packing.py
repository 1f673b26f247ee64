"""The ragged layout (models/packing.py): rows packed into a flat token batch, and a packed target forward
that gives the padded forward's logits and hidden states at every packed entry (torch ops, the C++ kernels,
the row-invariant float32 products, a GGUF model's C++ layer stack) and writes the same K/V there."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM
from flashtree.kernels.cpu.layer_stack import LayerStack
from flashtree.kernels.cpu.library import KernelUnavailable, kernels_available, load_kernels
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.build import build_model
from flashtree.models.config import ModelConfig
from flashtree.models.packing import pack_rows
from tests.support.checkpoints import isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)


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
    config = model.config
    cache = KVCache(KVCacheSpec(config.num_hidden_layers, 4, 32, 8, config.num_key_value_heads, config.head_dim),
                    torch.float32, "cpu")
    width = int(lengths.max())
    ids = (torch.arange(lengths.numel() * width).view(-1, width) * 7) % config.vocab_size
    slots = torch.arange(lengths.numel())
    model(ForwardBatch(ids, torch.arange(width).expand(lengths.numel(), -1), slots, torch.zeros_like(lengths),
                       causal_mask(lengths, width), width, prefill=True), cache, logits_index=(lengths - 1)[:, None])
    cache.advance(slots, lengths)
    return cache


def tree_batch(lengths: torch.Tensor, counts: torch.Tensor, vocab: int = CONFIG.vocab_size) -> ForwardBatch:
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
    ids = (torch.arange(rows * width).view(rows, width) * 11 + 3) % vocab
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


def packed_differences(padded, padded_cache: KVCache, packed, packed_cache: KVCache, packing,
                       lengths: torch.Tensor) -> dict[str, float]:
    """The largest difference between a packed forward and the padded one at the packed entries: of the
    logits, of the captured hidden states, and of every packed entry's K/V in each layer."""
    real = packing.padded_of < packing.flat_of.numel()  # [T] flat tokens that are real
    worst = {name: float((getattr(packed, name)[0][real] - packing.gather(getattr(padded, name))[real]).abs().max())
             for name in ("logits", "hidden")}
    for layer in range(packed_cache.storage.shape[0]):
        for row, (start, count) in enumerate(zip(lengths.tolist(), packing.packed.sum(1).tolist())):
            want, _ = padded_cache.view(layer, torch.tensor([row]), start + count)
            got, _ = packed_cache.view(layer, torch.tensor([row]), start + count)
            worst[f"kv {layer}"] = max(worst.get(f"kv {layer}", 0.0), float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize("kernels", ["torch", "cpp", "held"])
def test_packed_forward_gives_the_padded_forward_at_packed_entries(kernels):
    [(padded, padded_cache), (packed, packed_cache)], packing, batch, lengths = both_layouts(kernels, total=11)
    assert packed.logits.shape == (1, 11, CONFIG.vocab_size) and packed.hidden.shape == (1, 11, 2 * CONFIG.hidden_size)
    assert int((packing.padded_of < batch.input_ids.numel()).sum()) == 9  # flat tokens that are real (9 of 11)
    tolerance = 0.0 if kernels == "held" else 1e-5  # (held products are row-invariant: the same bits)
    differences = packed_differences(padded, padded_cache, packed, packed_cache, packing, lengths)
    assert all(value <= tolerance for value in differences.values()), differences
    assert padded.logits.std() > 0.1


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_layer_stack_runs_a_packed_forward_as_the_layer_loop_does(tmp_path, monkeypatch, model_type):
    """A GGUF model's packed verify forward through the C++ layer stack: the same bits as its layer-by-layer
    packed forward (logits, captured hidden states, K/V) and as the padded forward at every packed entry."""
    if not kernels_available()[0]:
        pytest.skip("the C++ kernel library does not build here")
    model = LLM(str(tiny_gguf(tmp_path / "tiny.gguf", model_type)), device="cpu", max_context=64).engine.model
    stacked_layouts = []  # the packing of each forward the stack ran
    run_stack = LayerStack.__call__
    monkeypatch.setattr(LayerStack, "__call__", lambda self, *args, **kwargs: (
        stacked_layouts.append(kwargs.get("packing")), run_stack(self, *args, **kwargs))[1])
    lengths, counts = torch.tensor([6, 3, 9, 4]), torch.tensor([5, 1, 0, 3])
    batch, packing = tree_batch(lengths, counts, model.config.vocab_size), pack_rows(counts, 5, 11)
    runs = {}
    for stack in (True, False):
        assert model.use_layer_stack(stack) == stack
        for layout in (None, packing):
            cache = prefilled_cache(model, lengths)
            runs[stack, layout is None] = model(batch._replace(packing=layout), cache, capture_layers=(0, 1)), cache
    assert [layout is packing for layout in stacked_layouts[-2:]] == [False, True]  # (the prefills ran it too)
    for padded in (True, False):
        (stacked, stacked_cache), (looped, looped_cache) = runs[True, padded], runs[False, padded]
        assert torch.equal(stacked.logits, looped.logits) and torch.equal(stacked.hidden, looped.hidden), padded
        assert torch.equal(stacked_cache.storage, looped_cache.storage), padded
    (padded_out, padded_cache), (packed_out, packed_cache) = runs[True, True], runs[True, False]
    assert packed_out.logits.shape[:2] == (1, 11) and padded_out.logits.std() > 0.1
    differences = packed_differences(padded_out, padded_cache, packed_out, packed_cache, packing, lengths)
    assert all(value == 0.0 for value in differences.values()), differences  # the same bits


def test_a_packed_forward_takes_no_logits_index():
    model = build_model(CONFIG, None, torch.device("cpu"), torch.float32, seed=3)
    lengths, counts = torch.tensor([2, 2]), torch.tensor([2, 2])
    batch = tree_batch(lengths, counts)._replace(packing=pack_rows(counts, 5, 4))
    with pytest.raises(ValueError, match="logits_index"):
        model(batch, prefilled_cache(model, lengths), logits_index=torch.zeros(2, 1, dtype=torch.long))
