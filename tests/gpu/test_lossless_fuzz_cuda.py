"""CUDA only: the lossless fuzz of tests/integration/test_lossless_fuzz.py on the device, with start-up CUDA
graphs and the Triton kernels: in float32, and in bfloat16 with the exact mode (issue #29), every draw's
speculative tokens equal plain decoding's with the same settings, all at once and with arrivals and aborts. No
copying drafter: the test double reads the engine's requests on the host, inside what a CUDA graph captures."""

import pytest
import torch

from tests.dflash_helpers import tiny_pair
from tests.support.lossless_fuzz import VOCAB, check_all_at_once, check_arrivals_and_aborts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODES = [("float32", {"warm_up": False}), ("bfloat16", {"exact": True, "warm_up": False})]  # (warm-up: start-up time only)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("fuzz"), vocab=VOCAB, block_size=6)


@pytest.mark.parametrize("dtype,extra", MODES, ids=["fp32", "bf16_exact"])
@pytest.mark.parametrize("seed", range(12))
def test_speculation_gives_plain_tokens_under_random_settings_on_cuda(pair, monkeypatch, dtype, extra, seed):
    check_all_at_once(pair, monkeypatch, seed, device="cuda", dtype=dtype, extra=extra, copying=False)


@pytest.mark.parametrize("dtype,extra", MODES, ids=["fp32", "bf16_exact"])
@pytest.mark.parametrize("seed", range(6))
def test_arrivals_and_aborts_on_cuda(pair, monkeypatch, dtype, extra, seed):
    check_arrivals_and_aborts(pair, monkeypatch, seed, device="cuda", dtype=dtype, extra=extra, copying=False)
