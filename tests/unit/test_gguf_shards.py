"""A GGUF conversion writes its float32 weights shard by shard as it converts them (a conversion holds
one shard in memory, not the model): past ``SHARD_BYTES`` Hugging Face's numbered shards and index,
which load like the single file, and from which the CPU block kernel's row checks read."""

from __future__ import annotations

import json

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.kernels.cpu.library import kernels_available
from flashtree.models import gguf_convert
from flashtree.models.loader import load_checkpoint, resolve_model_dir
from tests.support.checkpoints import holders, isolated_caches, tiny_gguf  # noqa: F401 (autouse fixture)

PROMPTS = [[1, 5, 7], list(range(3, 20))]


def test_write_weights_cuts_shards_in_order(tmp_path):
    tensors = [(f"t{i}", torch.full((4, 8), float(i))) for i in range(5)]  # 128 bytes each
    gguf_convert.write_weights(iter(tensors), tmp_path, shard_bytes=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"] == {"t0": files[0], "t1": files[0], "t2": files[1], "t3": files[1], "t4": files[2]}
    assert index["metadata"]["total_size"] == 5 * 128
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, "model.safetensors.index.json"])
    one = tmp_path / "one"
    one.mkdir()
    gguf_convert.write_weights(iter(tensors), one, shard_bytes=10_000)
    assert [p.name for p in one.iterdir()] == ["model.safetensors"]


def test_a_tensor_past_the_limit_gets_a_shard_of_its_own(tmp_path):
    tensors = [("small", torch.zeros(2)), ("big", torch.zeros(100)), ("after", torch.zeros(2))]
    gguf_convert.write_weights(iter(tensors), tmp_path, shard_bytes=64)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3


@pytest.mark.skipif(not kernels_available()[0], reason="CPU block kernel unavailable")
def test_sharded_conversion_loads_and_decodes_like_one_file(tmp_path, monkeypatch):
    """The same GGUF converted into one file and into shards of a few KB: the same weights, the blocks
    attached (their rows checked against the shards) and the same greedy tokens."""
    single = tiny_gguf(tmp_path / "single.gguf")
    expected = load_checkpoint(str(single)).weights
    engine = dict(device="cpu", max_running=2, max_context=64)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = [o.token_ids for o in LLM(str(single), **engine).generate(PROMPTS, params)]
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 16 * 1024)
    sharded = tiny_gguf(tmp_path / "sharded.gguf")
    directory = resolve_model_dir(str(sharded))
    assert not (directory / "model.safetensors").exists()
    assert len(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())) > 3
    weights = load_checkpoint(str(sharded)).weights
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    llm = LLM(str(sharded), **engine)
    assert all(h is not None for h in holders(llm.engine.model))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == tokens
