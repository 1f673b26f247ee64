"""CUDA only: a DFlash2 drafter on the GPU (Triton kernels, CUDA graphs captured at start-up, the
Triton tree build) gives plain decoding's tokens as the DFlash chain and as DDTree, in float32 and
bfloat16, greedy and seeded; its proposals match the CPU float32 drafter's."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.drafters import load_drafter
from tests.helpers import ours_from_hf
from tests.support.dflash2_checkpoints import tiny_dflash2_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 2, 3], list(range(2, 20)), [7] * 9]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 64)])
def test_dflash2_rounds_equal_plain(tmp_path, spec, budget, dtype):
    pair = tiny_dflash2_pair(tmp_path, vocab=24, block_size=6, drafter_layers=2)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=s) for s in range(3)]
    common = {"device": "cuda", "dtype": dtype, "max_running": 4, "max_context": 256}
    plain = LLM(str(pair.target), **common)
    fast = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=budget, **common)
    for params in (greedy, seeded):
        expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in fast.generate(PROMPTS, params)] == expected
    assert fast.engine.runner.graphs is not None and fast.engine.runner.graphs.graphs


def test_gpu_proposals_match_cpu(tmp_path):
    pair = tiny_dflash2_pair(tmp_path, vocab=24, block_size=6, drafter_layers=2)
    tokens = [5, 9, 2, 20, 17, 8, 8, 1, 12]
    outs = []
    for device in ("cpu", "cuda"):
        target = ours_from_hf(pair.hf, device=device)
        drafter = load_drafter(str(pair.drafter), target)
        if device == "cuda":
            assert drafter.use_gpu_kernels(attention=True)
        cache = drafter.new_cache(max_slots=1, max_context=32, scratch=8)
        with torch.no_grad():
            states = pair.hf.to(device)(torch.tensor([tokens], device=device), output_hidden_states=True).hidden_states
        feats = torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], -1)[:, :8]  # [1, 8, F]
        one = torch.tensor([0], device=device)
        drafter.observe(cache, one, feats, torch.tensor([8], device=device), torch.tensor([0], device=device))
        outs.append(drafter.draft_logits(cache, one, torch.tensor([tokens[8]], device=device),
                                         torch.tensor([8], device=device), kv_len=cache.spec.capacity).cpu())
        pair.hf.to("cpu")
    cpu, gpu = outs
    assert torch.equal(torch.isfinite(cpu), torch.isfinite(gpu))
    assert torch.equal(cpu.argmax(-1), gpu.argmax(-1))
    finite = torch.isfinite(cpu)
    assert (cpu[finite] - gpu[finite]).abs().max().item() < 1e-3
