"""The data-parallel router (server/router.py): prefix affinity by chained block hashes, the
least-loaded fallback, the imbalance limit, bounded memory; and each replica's devices."""

from __future__ import annotations

import pytest

from flashtree.config import EngineConfig
from flashtree.server.replicas import replica_configs
from flashtree.server.router import LEADING_BLOCKS, PrefixRouter


def test_a_conversation_stays_on_the_replica_holding_its_prefix():
    router = PrefixRouter(2, block_tokens=4, max_imbalance=8)
    first_turn = list(range(10))  # 2 whole blocks
    assert router.route(first_turn, [0, 0]) == (0, "least_loaded", 0)
    assert router.route([50, 51, 52, 53, 54], [0, 0]).replica == 1  # (the tie goes to the one routed less)
    assert router.route([60, 61, 62, 63], [0, 0]).replica == 0
    second_turn = first_turn + [20, 21, 22, 23, 24, 25]  # the first turn, its answer, the next question
    route = router.route(second_turn, [3, 0])  # (least-loaded would say 1)
    assert route == (0, "affinity", 2)
    assert router.route(second_turn + [30, 31, 32], [0, 5]) == (0, "affinity", 4)


def test_the_deepest_remembered_block_wins():
    router = PrefixRouter(2, block_tokens=2, max_imbalance=8)
    system = [7, 7, 7, 7]
    assert router.route(system + [1, 2], [0, 0]).replica == 0
    assert router.route([9, 9], [0, 0]).replica == 1
    router._remember(router.block_hashes(system + [3, 4]), 1)  # another conversation with the same system prompt on 1
    assert router.route(system + [3, 4, 5, 6], [0, 0]) == (1, "affinity", 3)
    assert router.route(system + [1, 2, 8, 8], [0, 0]) == (0, "affinity", 3)
    assert router.route(system + [5, 5], [0, 0]) == (0, "affinity", 2)  # (the system prompt's blocks: last taken by 0)


def test_an_overloaded_affinity_replica_gives_way_to_the_least_loaded():
    router = PrefixRouter(2, block_tokens=2, max_imbalance=3)
    prompt = [1, 2, 3, 4]
    assert router.route(prompt, [0, 0]).replica == 0
    assert router.route(prompt, [3, 0]) == (0, "affinity", 2)
    assert router.route(prompt, [4, 0]) == (1, "least_loaded", 0)
    assert router.route(prompt, [4, 0]) == (1, "affinity", 2)  # (replica 1 now holds it)


def test_short_prompts_and_hash_limits():
    router = PrefixRouter(3, block_tokens=4, max_imbalance=0, remembered_blocks=4)
    assert router.block_hashes([1, 2, 3]) == []  # no whole block: always least-loaded
    assert [router.route([1, 2, 3], [0, 0, 0]).replica for _ in range(3)] == [0, 1, 2]
    long = list(range(4 * (LEADING_BLOCKS + 10)))
    assert len(router.block_hashes(long)) == LEADING_BLOCKS
    assert router.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])[0] == router.block_hashes([1, 2, 3, 4, 9, 9, 9, 9])[0]
    assert router.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])[1] != router.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])[1]
    router.route(list(range(40)), [0, 0, 0])
    assert len(router._owner) == 4  # the least recently used blocks were forgotten
    with pytest.raises(ValueError, match="replicas >= 1"):
        PrefixRouter(0, 4, 1)


def test_replicas_share_a_cpu_and_take_their_own_cuda_devices(monkeypatch):
    config = EngineConfig.of(device="cpu", tensor_parallel_size=2)
    assert replica_configs(config, 3) == [config] * 3
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = EngineConfig.of(device="cuda:2", tensor_parallel_size=2)
    assert [c.target.device for c in replica_configs(cuda, 3)] == ["cuda:2", "cuda:4", "cuda:6"]
    with pytest.raises(Exception, match="needs 10 CUDA devices, this machine has 8"):
        replica_configs(cuda, 4)

