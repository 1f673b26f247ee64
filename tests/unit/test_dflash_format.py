"""The z-lab DFlash drafter format: both config layouts, the forward semantics against an
independent reference written from DESIGN.md section 2 (tests/support/dflash_reference.py), and
one test per validation rule (each error names the file, the key and the value). The engine's
feeding of the drafter: tests/integration/test_dflash_format.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flashtree import LLM
from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashDrafter, load_drafter
from flashtree.models.dflash_config import default_target_layer_ids, parse_dflash_config
from flashtree.models.transformer import CausalLM
from flashtree.speculative.ddtree import DDTreeProposer, default_budget
from tests.dflash_helpers import (
    drafter_weight_shapes,
    one_thread,
    random_drafter_weights,
    save_tiny_drafter,
    save_tiny_tokenizer,
    tiny_drafter_config,
    tiny_pair,
    write_drafter,
)
from tests.helpers import ours_from_hf
from tests.support.dflash_reference import reference_draft_logits

VOCAB = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"), vocab=VOCAB)


@pytest.fixture(scope="module")
def target(pair):
    return ours_from_hf(pair.hf)


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def edited_drafter(pair, tmp_path, edit=None, **save_kwargs) -> Path:
    """A copy of a tiny drafter whose config.json dict went through ``edit``."""
    out = save_tiny_drafter(pair.target, tmp_path / "drafter", **save_kwargs)
    if edit is not None:
        path = out / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return out


def load_error(pair, target, tmp_path, edit=None, tokenizer=None, error=ConfigError, **kwargs) -> str:
    directory = edited_drafter(pair, tmp_path, edit, **{k: v for k, v in kwargs.items() if k != "block_size_override"})
    with pytest.raises(error) as info:
        load_drafter(str(directory), target, tokenizer, block_size_override=kwargs.get("block_size_override"))
    message = str(info.value)
    assert str(directory) in message  # the file is named
    return message


# ---------------------------------------------------------------------------- reference forward

@torch.no_grad()
def hf_features(hf, drafter, tokens: list[int]) -> torch.Tensor:
    states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in drafter.config.target_layer_ids], -1)  # [n, F]


def observe_rows(drafter, cache, slots, sequences, spans):
    """One batched observe: row r gets tokens spans[r] = (start, end) of sequences[r], padded
    with garbage features (as the engine's padded rows are)."""
    width = max(end - start for start, end in spans)
    feats = torch.randn(len(slots), width, drafter.config.context_width)
    for r, (start, end) in enumerate(spans):
        feats[r, :end - start] = sequences[r][start:end]
    drafter.observe(cache, torch.tensor(slots), feats, torch.tensor([e - s for s, e in spans]),
                    torch.tensor([s for s, _ in spans]))


@pytest.mark.parametrize("layout", ["rope_theta", "rope_parameters"])
@pytest.mark.parametrize("slots", [[2, 0, 3], [1, 2, 3]])
def test_incremental_batched_drafter_matches_reference(pair, target, tmp_path, layout, slots):
    directory = save_tiny_drafter(pair.target, tmp_path / "d", block_size=5, layers=2, layout=layout, seed=3)
    drafter = load_drafter(str(directory), target)
    assert drafter.config.rope_theta == 10000.0 and drafter.config.block_size == 5
    cache = drafter.new_cache(max_slots=4, max_context=64, scratch=16)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 23, 4)]
    feats = [hf_features(pair.hf, drafter, t) for t in tokens]
    checkpoints = [(2, 11, 1), (7, 20, 3)]  # context lengths at which to draft
    done = [0, 0, 0]
    for lengths in checkpoints:
        spans = [(done[r], lengths[r]) for r in range(3)]
        observe_rows(drafter, cache, slots, feats, spans)
        done = list(lengths)
        bonus = torch.tensor([tokens[r][lengths[r]] for r in range(3)])
        starts = torch.tensor(lengths)
        ours = drafter.draft_logits(cache, torch.tensor(slots), bonus, starts, kv_len=max(lengths) + 5)
        assert ours.shape == (3, 4, VOCAB)
        for r in range(3):
            ref = reference_draft_logits(pair.hf, directory, tokens[r][:lengths[r]], tokens[r][lengths[r]])
            assert (ours[r] - ref).abs().max().item() < 1e-4


def test_sliding_window_layers_see_only_recent_context(pair, target, tmp_path):
    def sliding(config):
        config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)

    directory = edited_drafter(pair, tmp_path, sliding, layers=2)
    drafter = load_drafter(str(directory), target)
    assert drafter.config.window(0) == 3 and drafter.config.window(1) is None
    cache = drafter.new_cache(max_slots=2, max_context=32, scratch=8)
    tokens = list(range(3, 15))
    observe_rows(drafter, cache, [0], [hf_features(pair.hf, drafter, tokens)], [(0, 11)])
    ours = drafter.draft_logits(cache, torch.tensor([0]), torch.tensor([tokens[11]]), torch.tensor([11]), kv_len=15)
    ref = reference_draft_logits(pair.hf, directory, tokens[:11], tokens[11])
    assert (ours[0] - ref).abs().max().item() < 1e-4


def test_attention_bias_drafter_matches_reference(pair, target, tmp_path):
    config = tiny_drafter_config(pair.target, block_size=3) | {"attention_bias": True}
    directory = write_drafter(tmp_path / "bias", config, random_drafter_weights(config, seed=5))
    drafter = load_drafter(str(directory), target)
    assert drafter.layers[0].self_attn.o_proj.bias is not None
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = [5, 9, 2, 30, 17, 8, 8]
    observe_rows(drafter, cache, [0], [hf_features(pair.hf, drafter, tokens)], [(0, 6)])
    ours = drafter.draft_logits(cache, torch.tensor([0]), torch.tensor([tokens[6]]), torch.tensor([6]), kv_len=9)
    ref = reference_draft_logits(pair.hf, directory, tokens[:6], tokens[6])
    assert (ours[0] - ref).abs().max().item() < 1e-4


def test_shallow_drafts_are_the_first_positions_of_the_full_draft(pair, target):
    """draft_logits(depth=k) runs the whole block through the layers and the lm_head on the
    first k positions only: the same logits as the full draft's first k."""
    drafter = load_drafter(str(pair.drafter), target)
    cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
    tokens = [5, 9, 2, 30, 17, 8, 8]
    observe_rows(drafter, cache, [0], [hf_features(pair.hf, drafter, tokens)], [(0, 6)])
    args = (cache, torch.tensor([0]), torch.tensor([tokens[6]]), torch.tensor([6]))
    full = drafter.draft_logits(*args, kv_len=6 + drafter.config.block_size)
    for depth in range(1, drafter.config.block_size):
        shallow = drafter.draft_logits(*args, kv_len=6 + drafter.config.block_size, depth=depth)
        assert shallow.shape[1] == depth and torch.allclose(shallow, full[:, :depth], atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        drafter.draft_logits(*args, kv_len=6 + drafter.config.block_size, depth=drafter.config.block_size)


# ---------------------------------------------------------------------------- real checkpoints

ZLAB_QWEN3_8B = {  # config.json of z-lab/Qwen3-8B-DFlash-b16 (as published; unused keys trimmed)
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True)


def test_zlab_qwen3_8b_config_and_tensor_names():
    config = parse_dflash_config(ZLAB_QWEN3_8B, "z-lab/config.json", QWEN3_8B)
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.mask_token_id == 151669
    assert config.block_size == 16 and config.mask_token == "<|MASK|>" and config.rope_theta == 1e6
    with torch.device("meta"):
        drafter = DFlashDrafter(config, CausalLM(QWEN3_8B))
    ours = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert ours == drafter_weight_shapes(ZLAB_QWEN3_8B)
    assert ours["fc.weight"] == (4096, 5 * 4096)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(30, 3) == (1, 14, 27)


# ---------------------------------------------------------------------------- layouts and loading

def test_hub_id_resolves_through_the_hub_cache(pair, target, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-dflash"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(pair.drafter, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert load_drafter("tiny-org/tiny-dflash", target).config.block_size == 4
    with pytest.raises(CheckpointError, match="tiny-org/not-cached"):
        load_drafter("tiny-org/not-cached", target)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_drafter(str(tmp_path / "nowhere"), target)


def test_block_size_override_lowers_and_never_raises(pair, target, tmp_path):
    directory = save_tiny_drafter(pair.target, tmp_path / "b6", block_size=6)
    assert load_drafter(str(directory), target, block_size_override=3).config.block_size == 3
    llm = LLM(str(pair.target), spec="ddtree", draft=str(directory), block_size=3, budget=5, max_context=64)
    assert isinstance(llm.engine.proposer, DDTreeProposer)
    assert llm.engine.proposer.max_depth == 2 and llm.engine.proposer.max_nodes == 5
    with pytest.raises(ConfigError) as info:
        load_drafter(str(directory), target, block_size_override=7)
    message = str(info.value)
    assert str(directory) in message and "'block_size' = 6" in message and "7" in message and "lowered" in message


def test_default_budget():
    assert default_budget(torch.device("cpu")) == 4 and default_budget(torch.device("cuda")) == 64


# ---------------------------------------------------------------------------- validation rules

def test_target_layer_ids_empty(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, target_layer_ids=[])
    assert "dflash_config.target_layer_ids" in msg and "[]" in msg and "non-empty" in msg


def test_target_layer_ids_out_of_range(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, target_layer_ids=[0, 3])
    assert "dflash_config.target_layer_ids" in msg and "[0, 3]" in msg and "[0, 3)" in msg


def test_target_layer_ids_not_integers(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, target_layer_ids=[0, "1"])
    assert "dflash_config.target_layer_ids" in msg and "'1'" in msg and "integers" in msg


def test_target_layer_ids_default_spread(pair, target, tmp_path):
    directory = save_tiny_drafter(pair.target, tmp_path / "spread", layers=2, target_layer_ids=None)
    assert "target_layer_ids" not in json.loads((directory / "config.json").read_text())["dflash_config"]
    # L = 3 target layers, n = 2 drafter layers: round(1 + i * (L - 4) / (n - 1)) = [1, 0]
    assert load_drafter(str(directory), target).config.target_layer_ids == (1, 0)


def test_target_layer_ids_default_spread_out_of_range(tmp_path):
    raw = tiny_drafter_config({"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 16}, layers=3,
                              target_layer_ids=None)
    tiny_target = ModelConfig(model_type="qwen3", vocab_size=16, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              rms_norm_eps=1e-6, rope_theta=1e4)
    with pytest.raises(ConfigError) as info:
        parse_dflash_config(raw, "some/config.json", tiny_target)
    msg = str(info.value)
    assert "some/config.json" in msg and "target_layer_ids" in msg and "-1" in msg and "spread" in msg


def test_mask_token_empty(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, lambda c: c["dflash_config"].update(mask_token=""))
    assert "dflash_config.mask_token" in msg and "''" in msg and "non-empty string" in msg


def test_mask_token_not_a_string(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, lambda c: c["dflash_config"].update(mask_token=5))
    assert "dflash_config.mask_token" in msg and "5" in msg and "string" in msg


@pytest.mark.parametrize("bad", [VOCAB, -1, "7"])
def test_mask_token_id_out_of_range(pair, target, tmp_path, bad):
    msg = load_error(pair, target, tmp_path, mask_token_id=bad)
    assert "dflash_config.mask_token_id" in msg and repr(bad) in msg and f"[0, {VOCAB})" in msg


def tokenizer_with(tmp_path, vocab: int, extra: list[str] = ()):
    from flashtree.models.loader import load_tokenizer

    save_tiny_tokenizer(tmp_path / "tok", vocab)
    tokenizer = load_tokenizer(tmp_path / "tok")
    if extra:
        tokenizer.add_tokens(list(extra), special_tokens=True)
    return tokenizer


def test_mask_token_id_disagrees_with_tokenizer(pair, target, tmp_path):
    tokenizer = tokenizer_with(tmp_path, VOCAB, ["<|MASK|>"])  # id VOCAB - 2
    known = tokenizer.convert_tokens_to_ids("<|MASK|>")
    msg = load_error(pair, target, tmp_path, tokenizer=tokenizer, mask_token_id=5)
    assert "dflash_config.mask_token_id" in msg and "5" in msg and str(known) in msg and "<|MASK|>" in msg
    agreeing = save_tiny_drafter(pair.target, tmp_path / "agree", mask_token_id=known)
    assert load_drafter(str(agreeing), target, tokenizer).config.mask_token_id == known


def test_mask_token_found_in_tokenizer(pair, target, tmp_path):
    tokenizer = tokenizer_with(tmp_path, VOCAB, ["<|MASK|>"])
    directory = save_tiny_drafter(pair.target, tmp_path / "noid", mask_token_id=None)
    drafter = load_drafter(str(directory), target, tokenizer)
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|MASK|>")


def test_mask_token_added_to_tokenizer(pair, target, tmp_path):
    tokenizer = tokenizer_with(tmp_path, VOCAB)
    before = len(tokenizer)
    assert "<|MASK|>" not in tokenizer.get_vocab() and before < VOCAB
    directory = save_tiny_drafter(pair.target, tmp_path / "noid", mask_token_id=None)
    drafter = load_drafter(str(directory), target, tokenizer)
    assert drafter.config.mask_token_id == before == tokenizer.get_vocab()["<|MASK|>"]
    assert tokenizer.eos_token == "</s>" and "<|im_end|>" in tokenizer.all_special_tokens  # others kept


def test_mask_token_without_embedding_row(pair, target, tmp_path):
    tokenizer = tokenizer_with(tmp_path, VOCAB, ["x1", "x2"])  # the tokenizer fills every target row
    assert len(tokenizer) == VOCAB
    msg = load_error(pair, target, tmp_path, tokenizer=tokenizer, mask_token_id=None)
    assert "mask_token_id" in msg and "<|MASK|>" in msg and "no embedding row" in msg and str(VOCAB) in msg
    assert "<|MASK|>" not in tokenizer.get_vocab()  # refused before touching the tokenizer


def test_mask_token_id_missing_without_tokenizer(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, mask_token_id=None)
    assert "dflash_config.mask_token_id" in msg and "missing" in msg and "<|MASK|>" in msg


def test_hidden_size_mismatch(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, lambda c: c.update(hidden_size=64))
    assert "'hidden_size' = 64" in msg and "32" in msg and "another target" in msg


def test_num_target_layers_mismatch(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, lambda c: c.update(num_target_layers=36))
    assert "'num_target_layers' = 36" in msg and "3 layers" in msg


def test_mismatched_pair_names_every_number(pair, target, tmp_path):
    msg = load_error(pair, target, tmp_path, lambda c: c.update(hidden_size=4096, num_target_layers=36))
    assert "'hidden_size' = 4096" in msg and "'num_target_layers' = 36" in msg


@pytest.mark.parametrize("bad", [1, 0, "16", None])
def test_block_size_at_least_two(pair, target, tmp_path, bad):
    def edit(config):
        if bad is None:
            del config["block_size"]
        else:
            config["block_size"] = bad

    msg = load_error(pair, target, tmp_path, edit)
    assert "'block_size'" in msg and (">= 2" in msg) and (bad is None or repr(bad) in msg)


def test_fc_width_must_match_layer_ids(pair, target, tmp_path):
    directory = save_tiny_drafter(pair.target, tmp_path / "fc", target_layer_ids=[0, 1, 2])
    raw = json.loads((directory / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 2]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_drafter(str(directory), target)
    msg = str(info.value)
    assert str(directory) in msg and "fc.weight" in msg and "[32, 96]" in msg and "64" in msg


@pytest.mark.parametrize("edit, key", [
    (lambda c: c.update(layer_types=["full_attention", "global"]), "layer_types"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window"),
])
def test_layer_types(pair, target, tmp_path, edit, key):
    msg = load_error(pair, target, tmp_path, edit, layers=2)
    assert f"'{key}'" in msg and "allowed" in msg


def test_target_directory_is_not_a_drafter(pair, target):
    with pytest.raises(ConfigError) as info:
        load_drafter(str(pair.target), target)
    assert str(pair.target) in str(info.value) and "not a DFlash drafter" in str(info.value)


def test_missing_and_unexpected_tensors(pair, target, tmp_path):
    directory = save_tiny_drafter(pair.target, tmp_path / "t")
    weights = safetensors.torch.load_file(str(directory / "model.safetensors"))
    safetensors.torch.save_file({k: v for k, v in weights.items() if "k_norm" not in k},
                                str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="k_norm"):
        load_drafter(str(directory), target)
    safetensors.torch.save_file(weights | {"embed_tokens.weight": torch.zeros(VOCAB, 32)},
                                str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_drafter(str(directory), target)
