"""Tensor parallelism's pieces without processes: the shard config and its errors, the weight splits
(the shards put back together give the whole tensors), the vocabulary rows, the messages to the
workers (packed and unpacked unchanged), the config and its flag, and a single-process model that
carries no collective hooks."""

from __future__ import annotations

import argparse

import pytest
import torch

from flashtree.cli.args import add_model_args, engine_config_from_args
from flashtree.config import EngineConfig, ParallelConfig
from flashtree.engine.tp_messages import (
    commit_buffer,
    forward_buffers,
    pack_commit,
    pack_forward,
    unpack_commit,
    unpack_forward,
)
from flashtree.errors import ConfigError
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.build import build_model
from flashtree.models.config import ModelConfig
from flashtree.models.parallel import shard_config, shard_tensor, vocab_rows

CONFIG = ModelConfig(model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                     qk_norm=True)


def test_shard_config_divides_heads_and_width():
    shard = shard_config(CONFIG, 4)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.intermediate_size) == (2, 1, 24)
    assert (shard.vocab_size, shard.hidden_size, shard.head_dim) == (50, 32, 8)
    assert shard_config(CONFIG, 1) is CONFIG


@pytest.mark.parametrize("world, word", [(8, "num_key_value_heads"), (3, "num_attention_heads")])
def test_shard_config_names_what_does_not_divide(world, word):
    with pytest.raises(ConfigError, match=word):
        shard_config(CONFIG, world)


def test_vocab_rows_cover_the_vocabulary_once():
    for vocab, world in ((50, 4), (48, 4), (33, 2), (7, 7)):
        rows = [vocab_rows(vocab, rank, world) for rank in range(world)]
        assert [first for first, _, _ in rows] == [end for _, end, _ in [(0, 0, 0)] + rows[:-1]]
        assert rows[-1][1] == vocab and all(end - first <= per for first, end, per in rows)


def test_shards_put_back_together_give_the_whole_tensors():
    model = build_model(CONFIG, None, torch.device("cpu"), torch.float32, seed=1)
    world = 4
    split = 0
    for name, whole in model.named_parameters():
        pieces = [shard_tensor(name, whole, rank, world) for rank in range(world)]
        if pieces[0].shape == whole.shape:  # replicated
            continue
        split += 1
        dim = next(d for d in range(whole.dim()) if pieces[0].shape[d] != whole.shape[d])
        assert torch.equal(torch.cat(pieces, dim=dim), whole)
    assert split == 2 * (4 + 3)  # per layer: q, k, v, o, gate, up, down


def test_single_process_model_has_no_collective_hooks():
    model = build_model(CONFIG, None, torch.device("cpu"), torch.float32)
    assert not any(module._forward_hooks for module in model.modules())


def test_forward_message_round_trip():
    counts = torch.tensor([3, 2])
    batch = ForwardBatch(torch.tensor([[4, 5, 6], [7, 8, 0]]), torch.tensor([[3, 4, 5], [9, 10, 11]]),
                         torch.tensor([1, 0]), torch.tensor([3, 9]), causal_mask(counts, 3), 12, True, True)
    for logits_index in (None, torch.tensor([[2], [1]])):
        meta, ints, mask = pack_forward(batch, logits_index)
        buffers = forward_buffers(meta, torch.device("cpu"))
        assert [b.shape for b in buffers] == [ints.shape, mask.shape] and buffers[1].dtype == mask.dtype
        got, index = unpack_forward(meta, ints, mask)
        for field in ("input_ids", "positions", "slots", "cache_lengths", "new_mask"):
            assert torch.equal(getattr(got, field), getattr(batch, field))
        assert (got.kv_len, got.one_off_shape, got.prefill) == (12, True, True)
        assert (index is None) if logits_index is None else torch.equal(index, logits_index)


def test_commit_message_round_trip():
    args = (torch.tensor([2, 0]), torch.tensor([5, 7]), torch.tensor([[0, 2, 3], [0, 1, -1]]), torch.tensor([3, 2]))
    shape, ints = pack_commit(*args)
    assert commit_buffer(shape, torch.device("cpu")).shape == ints.shape
    assert all(torch.equal(a, b) for a, b in zip(unpack_commit(shape, ints), args))


def test_parallel_config_and_flag():
    assert EngineConfig().parallel.tensor_parallel_size == 1
    assert EngineConfig.of(tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            ParallelConfig(tensor_parallel_size=bad)
    with pytest.raises(ConfigError, match="worker_timeout_s"):
        ParallelConfig(worker_timeout_s=0)
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", "x", "--tensor-parallel-size", "4", "--worker-timeout", "30"])
    parallel = engine_config_from_args(args).parallel
    assert (parallel.tensor_parallel_size, parallel.worker_timeout_s) == (4, 30.0)
