"""Lossless across the engine's settings at once (tests/support/lossless_fuzz.py draws them): for each seed, a
random speculative setup and random engine settings, with a batch of random requests, give at temperature 0 and
seeded sampling, in float32 on the CPU, exactly the tokens and finish reasons of plain decoding with the same
settings, all at once and with requests arriving between steps while others are aborted; with a DFlash and a
DFlash2 drafter; and with two tensor-parallel ranks. Each test id names its seed; a failure prints the whole draw."""

from __future__ import annotations

import pytest

from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (one_thread: a fixture)
from tests.support.dflash2_checkpoints import tiny_dflash2_pair
from tests.support.lossless_fuzz import VOCAB, check_all_at_once, check_arrivals_and_aborts, check_tensor_parallel

SEEDS = {"dflash": range(32), "dflash2": range(100, 116)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811 (the imported fixture)
    pass


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return {"dflash": tiny_pair(tmp_path_factory.mktemp("fuzz"), vocab=VOCAB, block_size=6),
            "dflash2": tiny_dflash2_pair(tmp_path_factory.mktemp("fuzz2"), vocab=VOCAB, block_size=6,
                                         drafter_layers=2)}


@pytest.mark.parametrize("arch,seed", [(arch, seed) for arch, seeds in SEEDS.items() for seed in seeds])
def test_speculation_gives_plain_tokens_under_random_settings(pairs, monkeypatch, arch, seed):
    check_all_at_once(pairs[arch], monkeypatch, seed)


@pytest.mark.parametrize("arch,seed", [(arch, seed) for arch, seeds in SEEDS.items() for seed in seeds[:12]])
def test_arrivals_and_aborts_leave_the_other_requests_tokens_alone(pairs, monkeypatch, arch, seed):
    check_arrivals_and_aborts(pairs[arch], monkeypatch, seed)


@pytest.mark.parametrize("seed", range(4))
def test_two_tensor_parallel_ranks_give_plain_tokens_under_random_settings(pairs, seed):
    check_tensor_parallel(pairs["dflash"], seed)
