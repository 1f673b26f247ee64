"""The DFlash2 drafter format: a tiny checkpoint in the public layout loads (tensor names and the
published 27B shapes), its proposals match an independent per-op reference
(tests/support/dflash2_reference.py) for batched rows of different lengths, and one test per
validation rule (each error names the file, the key and the value). Engine runs:
tests/integration/test_dflash2_lossless.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flashtree import LLM
from flashtree.errors import CheckpointError, ConfigError
from flashtree.models import dflash
from flashtree.models.config import ModelConfig
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.models.dflash2_config import parse_dflash2_config
from flashtree.models.drafters import load_drafter
from flashtree.models.transformer import CausalLM
from flashtree.speculative.tree import build_tree
from tests.dflash_helpers import (
    one_thread,  # noqa: F401 (a fixture)
    save_tiny_drafter,
    write_drafter,
)
from tests.helpers import ours_from_hf
from tests.support.dflash2_checkpoints import (
    dflash2_weight_shapes,
    random_dflash2_weights,
    save_tiny_dflash2,
    tiny_dflash2_config,
    tiny_dflash2_pair,
)
from tests.support.dflash2_reference import reference_dflash2

VOCAB = 32


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one CPU thread


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_dflash2_pair(tmp_path_factory.mktemp("dflash2"), vocab=VOCAB, block_size=5, drafter_layers=2)


@pytest.fixture(scope="module")
def target(pair):
    return ours_from_hf(pair.hf)


def features(hf, drafter, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in drafter.config.target_layer_ids], -1)  # [n, F]


def observe(drafter, cache, slots: list[int], feats: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
    """One batched observe: row r gets positions spans[r] of feats[r], padded with garbage."""
    width = max(end - start for start, end in spans)
    padded = torch.randn(len(slots), width, drafter.config.context_width)
    for r, (start, end) in enumerate(spans):
        padded[r, :end - start] = feats[r][start:end]
    drafter.observe(cache, torch.tensor(slots), padded, torch.tensor([e - s for s, e in spans]),
                    torch.tensor([s for s, _ in spans]))


def assert_matches_reference(ours: torch.Tensor, ref) -> None:
    """``ours [L, V]`` draft logits: their log-softmax is the reference's log q, -inf exactly off
    the candidates, and the per-slot argmax is the reference's walk."""
    ours_logq = ours.log_softmax(-1)
    finite = torch.isfinite(ref.log_probs)
    assert torch.equal(torch.isfinite(ours_logq), finite)
    assert (ours_logq[finite] - ref.log_probs[finite]).abs().max().item() < 1e-4
    assert ours.argmax(-1).tolist() == ref.path
    assert torch.equal(finite.sum(-1), torch.full((ours.shape[0],), ref.candidates.shape[1]))


# ---------------------------------------------------------------------------- loading

def test_tiny_checkpoint_loads_with_the_public_names(pair, target):
    drafter = load_drafter(str(pair.drafter), target)
    assert isinstance(drafter, DFlash2Drafter)
    stored = safetensors.torch.load_file(str(pair.drafter / "model.safetensors"))
    ours = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert ours == {name: tuple(t.shape) for name, t in stored.items()}
    assert ours == dflash2_weight_shapes(json.loads((pair.drafter / "config.json").read_text()))
    cfg = drafter.config
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 8, 8, 4)
    assert cfg.output_multiplier == 0.75 and cfg.final_logit_softcapping == 6.0 and cfg.input_embedding_scale == 1.0
    assert cfg.block_size == 5 and cfg.vocab_size == VOCAB
    assert torch.equal(drafter.candidate_selector.successor_codebook, stored["candidate_selector.successor_codebook"])


# config.json of the published DFlash2 fixture (z-lab/dflash tests/fixtures/dflash2-config.json, keys it
# does not use trimmed) and the target numbers it implies
PUBLISHED_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False,
    "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                      "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
                      "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]},
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 6656, "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 131072, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048, "use_sliding_window": True, "vocab_size": 202048,
}
PUBLISHED_TARGET = ModelConfig(model_type="qwen3", vocab_size=202048, hidden_size=6656, intermediate_size=17408,
                               num_hidden_layers=52, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                               rms_norm_eps=1e-6, rope_theta=5e5, qk_norm=True)
# shapes from the published safetensors header (tests/fixtures/dflash2-safetensors-header.json)
PUBLISHED_SHAPES = {
    "candidate_selector.hidden_projection.weight": (256, 6656), "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256), "fc.weight": (6656, 33280),
    "layers.0.attention_conv.base_kernel": (2, 2, 6656), "layers.0.attention_conv.kernel_projection.weight": (1664, 6656),
    "layers.4.mlp_conv.base_kernel": (2, 2, 6656), "layers.4.mlp_conv.kernel_projection.weight": (1664, 6656),
    "layers.4.self_attn.q_proj.weight": (4096, 6656), "layers.2.mlp.down_proj.weight": (6656, 19968),
}


def test_published_config_and_shapes():
    config = parse_dflash2_config(PUBLISHED_DFLASH2, "published/config.json", PUBLISHED_TARGET)
    assert config.sliding_window == 2048 and config.window(3) == 2048 and config.rope_theta == 5e5
    assert config.final_logit_softcapping == 20.0 and config.output_multiplier == pytest.approx(26 ** -0.5)
    assert config.block_size == 16 and config.conv_groups == 416 and config.mask_token_id == 201818
    with torch.device("meta"):
        drafter = DFlash2Drafter(config, CausalLM(PUBLISHED_TARGET))
    ours = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert ours == dflash2_weight_shapes(PUBLISHED_DFLASH2)
    assert len(ours) == 3 + 3 + 5 * 15  # fc, norms; selector; per layer 11 + 4 convolution tensors
    for name, shape in PUBLISHED_SHAPES.items():
        assert ours[name] == shape, name


# ---------------------------------------------------------------------------- forward vs reference

@pytest.mark.parametrize("slots", [[2, 0, 3], [1, 2, 3]])
def test_incremental_batched_proposals_match_reference(pair, target, slots):
    drafter = load_drafter(str(pair.drafter), target)
    cache = drafter.new_cache(max_slots=4, max_context=64, scratch=16)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 23, 4)]
    feats = [features(pair.hf, drafter, t) for t in tokens]
    done = [0, 0, 0]
    for lengths in [(2, 11, 1), (7, 20, 3)]:  # context lengths at which to draft
        observe(drafter, cache, slots, feats, [(done[r], lengths[r]) for r in range(3)])
        done = list(lengths)
        bonus = torch.tensor([tokens[r][lengths[r]] for r in range(3)])
        ours = drafter.draft_logits(cache, torch.tensor(slots), bonus, torch.tensor(lengths), kv_len=max(lengths) + 5)
        assert ours.shape == (3, 4, VOCAB) and ours.dtype == torch.float32
        for r in range(3):
            assert_matches_reference(ours[r], reference_dflash2(pair.hf, pair.drafter, tokens[r][:lengths[r]],
                                                                tokens[r][lengths[r]]))


@pytest.mark.parametrize("keys", [
    {"final_logit_softcapping": None, "output_multiplier": None, "input_embedding_scale": 1.5},
    {"conv_kernel_size": 3, "conv_group_size": 4, "selector_top_k": 7, "final_logit_softcapping": 0.0},
    {"conv_kernel_size": 1, "selector_rank": 3, "selector_top_k": VOCAB, "output_multiplier": 2.0},
])
def test_key_variants_match_reference(pair, target, tmp_path, keys):
    directory = save_tiny_dflash2(pair.target, tmp_path / "variant", block_size=5, layers=2, seed=7, **keys)
    drafter = load_drafter(str(directory), target)
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = [5, 9, 2, 30, 17, 8, 8, 1, 12]
    observe(drafter, cache, [0], [features(pair.hf, drafter, tokens)], [(0, 8)])
    ours = drafter.draft_logits(cache, torch.tensor([0]), torch.tensor([tokens[8]]), torch.tensor([8]), kv_len=13)
    assert_matches_reference(ours[0], reference_dflash2(pair.hf, directory, tokens[:8], tokens[8]))


def test_sliding_window_layer_matches_reference(pair, target, tmp_path):
    config = tiny_dflash2_config(pair.target, block_size=4, layers=2)
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3, use_sliding_window=True)
    directory = write_drafter(tmp_path / "window", config, random_dflash2_weights(config, seed=4))
    drafter = load_drafter(str(directory), target)
    assert drafter.config.window(0) == 3 and drafter.config.window(1) is None
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = list(range(3, 15))
    observe(drafter, cache, [0], [features(pair.hf, drafter, tokens)], [(0, 11)])
    ours = drafter.draft_logits(cache, torch.tensor([0]), torch.tensor([tokens[11]]), torch.tensor([11]), kv_len=15)
    assert_matches_reference(ours[0], reference_dflash2(pair.hf, directory, tokens[:11], tokens[11]))


def test_shallow_drafts_begin_the_full_walk(pair, target):
    """depth=k walks the first k slots: the full draft's first k rows (the walk goes left to right)."""
    drafter = load_drafter(str(pair.drafter), target)
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = [5, 9, 2, 30, 17, 8, 8]
    observe(drafter, cache, [0], [features(pair.hf, drafter, tokens)], [(0, 6)])
    args = (cache, torch.tensor([0]), torch.tensor([tokens[6]]), torch.tensor([6]))
    full = drafter.draft_logits(*args, kv_len=11)
    for depth in range(1, 5):
        shallow = drafter.draft_logits(*args, kv_len=11, depth=depth)
        assert shallow.shape[1] == depth and torch.allclose(shallow, full[:, :depth], atol=1e-5, rtol=0)
        assert torch.equal(shallow.argmax(-1), full[:, :depth].argmax(-1))
    with pytest.raises(ValueError):
        drafter.draft_logits(*args, kv_len=11, depth=5)


def test_the_selector_changes_the_proposal(pair, target):
    """With the codebooks zeroed the walk is the unary argmax; the checkpoint's codebooks move it
    somewhere (so the reference test checks the selector, not only the lm_head)."""
    drafter = load_drafter(str(pair.drafter), target)
    gen = torch.Generator().manual_seed(1)
    moved = 0
    for trial in range(8):
        tokens = torch.randint(0, VOCAB, (10,), generator=gen).tolist()
        cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
        observe(drafter, cache, [0], [features(pair.hf, drafter, tokens)], [(0, 9)])
        args = (cache, torch.tensor([0]), torch.tensor([tokens[9]]), torch.tensor([9]))
        walk = drafter.draft_logits(*args, kv_len=14).argmax(-1)
        saved = drafter.candidate_selector.predecessor_codebook.clone()
        drafter.candidate_selector.predecessor_codebook.zero_()
        unary_only = drafter.draft_logits(*args, kv_len=14).argmax(-1)
        drafter.candidate_selector.predecessor_codebook.copy_(saved)
        moved += int(not torch.equal(walk, unary_only))
    assert moved >= 2


def test_trees_hold_only_the_candidates_and_begin_with_the_walk(pair, target):
    """DDTree over a DFlash2 drafter's logits: every node's token is one of its slot's
    selector_top_k = 4 candidates; a budget of every prefix (4 + 16 + 64 + 256) holds exactly them;
    a small tree's best path (each node's first child) is the selector's walk."""
    drafter = load_drafter(str(pair.drafter), target)
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = [5, 9, 2, 30, 17, 8, 8]
    observe(drafter, cache, [0], [features(pair.hf, drafter, tokens)], [(0, 6)])
    logits = drafter.draft_logits(cache, torch.tensor([0]), torch.tensor([tokens[6]]), torch.tensor([6]), kv_len=11)
    candidates = [set(torch.isfinite(logits[0, d]).nonzero()[:, 0].tolist()) for d in range(4)]
    for host in (True, False):
        for budget in (340, 400):
            tree = build_tree(logits, budget, budget, host=host)
            valid, depths = tree.valid[0], tree.depths[0]
            assert int(valid.sum()) == 341  # the root and every prefix of candidates, nothing else
            assert [int(((depths == d) & valid).sum()) for d in range(1, 5)] == [4, 16, 64, 256]
            assert all(int(tree.tokens[0, n]) in candidates[int(depths[n]) - 1] for n in range(1, 341))
        tree = build_tree(logits, 6, 6, host=host)
        node, walk = 0, []
        for _ in range(4):
            children = ((tree.parents[0] == node) & tree.valid[0]).nonzero()[:, 0]
            if not len(children):
                break
            node = int(children[0])  # children are laid out best first
            walk.append(int(tree.tokens[0, node]))
        assert walk and walk == logits[0].argmax(-1).tolist()[:len(walk)]


def test_cpu_kernels_give_the_torch_proposals(pair, target):
    drafter = load_drafter(str(pair.drafter), target)
    fused = load_drafter(str(pair.drafter), target)
    if not fused.use_cpu_kernels():
        pytest.skip("the C++ kernels do not build here")
    tokens = [5, 9, 2, 30, 17, 8, 8, 1, 12]
    outs = []
    for model in (drafter, fused):
        cache = model.new_cache(max_slots=2, max_context=32, scratch=8)
        observe(model, cache, [1], [features(pair.hf, model, tokens)], [(0, 8)])
        outs.append(model.draft_logits(cache, torch.tensor([1]), torch.tensor([tokens[8]]), torch.tensor([8]),
                                       kv_len=cache.spec.capacity))
    assert torch.equal(torch.isfinite(outs[0]), torch.isfinite(outs[1]))
    finite = torch.isfinite(outs[0])
    assert (outs[0][finite] - outs[1][finite]).abs().max().item() < 1e-3


# ---------------------------------------------------------------------------- validation rules

def edited(pair, tmp_path: Path, edit=None, weights_edit=None) -> Path:
    config = tiny_dflash2_config(pair.target, block_size=4)
    if edit is not None:
        edit(config)
    weights = random_dflash2_weights(tiny_dflash2_config(pair.target, block_size=4), seed=2)
    if weights_edit is not None:
        weights_edit(weights)
    return write_drafter(tmp_path / "edited", config, weights)


def error_of(pair, target, tmp_path, edit=None, weights_edit=None, error=ConfigError) -> str:
    directory = edited(pair, tmp_path, edit, weights_edit)
    with pytest.raises(error) as info:
        load_drafter(str(directory), target)
    message = str(info.value)
    assert str(directory) in message  # the file is named
    return message


def test_required_keys(pair, target, tmp_path):
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        msg = error_of(pair, target, tmp_path / key, lambda c, k=key: c["dflash_config"].pop(k))
        assert f"dflash_config.{key}" in msg and "missing" in msg


def test_keys_at_the_top_level_are_read(pair, target, tmp_path):
    def move(config):
        config["selector_top_k"] = config["dflash_config"].pop("selector_top_k")
    assert load_drafter(str(edited(pair, tmp_path, move)), target).config.selector_top_k == 4


@pytest.mark.parametrize("key, value, allowed", [
    ("conv_kernel_size", 0, "an integer >= 1"), ("selector_rank", 2.5, "an integer >= 1"),
    ("conv_group_size", 5, "a divisor of hidden_size (32)"), ("selector_top_k", VOCAB + 1, f"[1, {VOCAB}]"),
    ("output_multiplier", 0, "a positive finite number"), ("input_embedding_scale", "2", "a positive finite number"),
    ("final_logit_softcapping", -1.0, "a finite number >= 0"),
])
def test_invalid_values(pair, target, tmp_path, key, value, allowed):
    msg = error_of(pair, target, tmp_path, lambda c: c["dflash_config"].update({key: value}))
    assert f"'dflash_config.{key}' = {value!r}" in msg and allowed in msg


@pytest.mark.parametrize("key, value, allowed", [
    ("is_causal", True, "false or absent"), ("hidden_act", "gelu", "'silu'"), ("vocab_size", VOCAB + 2, str(VOCAB)),
])
def test_invalid_top_level(pair, target, tmp_path, key, value, allowed):
    msg = error_of(pair, target, tmp_path, lambda c: c.update({key: value}))
    assert f"'{key}' = {value!r}" in msg and allowed in msg


def test_missing_and_unexpected_tensors(pair, target, tmp_path):
    msg = error_of(pair, target, tmp_path / "missing", weights_edit=lambda w: w.pop("layers.0.mlp_conv.base_kernel"),
                   error=CheckpointError)
    assert "layers.0.mlp_conv.base_kernel" in msg and "lack" in msg
    msg = error_of(pair, target, tmp_path / "extra", weights_edit=lambda w: w.update(extra=torch.zeros(2)),
                   error=CheckpointError)
    assert "'extra'" in msg and "candidate_selector" in msg


def test_wrong_codebook_shape(pair, target, tmp_path):
    def narrow(weights):
        weights["candidate_selector.successor_codebook"] = torch.zeros(VOCAB, 5)
    with pytest.raises(CheckpointError, match=r"successor_codebook has shape \[32, 5\].*\[32, 8\]"):
        load_drafter(str(edited(pair, tmp_path, weights_edit=narrow)), target)


def test_first_generation_loader_refuses_dflash2(pair, target):
    with pytest.raises(ConfigError, match="declares a DFlash2 drafter") as info:
        dflash.load_drafter(str(pair.drafter), target)
    assert str(pair.drafter) in str(info.value)


def test_first_generation_drafters_still_load_through_the_dispatch(pair, target, tmp_path):
    directory = save_tiny_drafter(pair.target, tmp_path / "v1")
    drafter = load_drafter(str(directory), target)
    assert type(drafter) is dflash.DFlashDrafter and not hasattr(drafter, "candidate_selector")


def test_draft_vocabulary_is_refused(pair):
    with pytest.raises(ConfigError, match="--draft-vocab 8 is not valid with a DFlash2 drafter"):
        LLM(str(pair.target), spec="dflash", draft=str(pair.drafter), draft_vocab=8, max_context=32)
