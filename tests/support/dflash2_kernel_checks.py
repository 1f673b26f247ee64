"""A DFlash2 drafter with the Triton kernels (fused layer ops, paged attention, tree build) against
torch ops, on CPU tensors under ``TRITON_INTERPRET=1`` (run in a subprocess by
tests/integration/test_dflash2_interpreter.py; ``python -m tests.support.dflash2_kernel_checks WORKDIR``
prints one JSON line of differences, 0 expected for the counts)."""

from __future__ import annotations

import json
import sys

import torch

from flashtree.models.drafters import load_drafter
from tests.helpers import ours_from_hf
from tests.support.dflash2_checkpoints import tiny_dflash2_pair


def compare_drafter(workdir: str) -> dict[str, float]:
    """Fused (Triton) vs unfused draft logits of one DFlash2 drafter: their largest difference at
    the candidates, and the slots whose candidates or walk differ."""
    pair = tiny_dflash2_pair(workdir + "/drafter", vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    target = ours_from_hf(pair.hf)
    outputs = []
    for fused in (False, True):
        drafter = load_drafter(str(pair.drafter), target)
        assert drafter.use_gpu_kernels(fused, attention=True) == fused
        cache = drafter.new_cache(max_slots=3, max_context=32, scratch=8)
        features = torch.randn(2, 6, drafter.fc.in_features, generator=torch.Generator().manual_seed(2))
        slots = torch.tensor([2, 0])
        drafter.observe(cache, slots, features, torch.tensor([6, 4]), torch.zeros(2, dtype=torch.long))
        outputs.append(drafter.draft_logits(cache, slots, torch.tensor([7, 9]), torch.tensor([6, 4]),
                                            kv_len=cache.spec.capacity))
    torch_ops, fused = outputs
    finite = torch.isfinite(torch_ops)
    return {"dflash2/candidate_slots_differing": float((finite != torch.isfinite(fused)).any(-1).sum()),
            "dflash2/walk_slots_differing": float((torch_ops.argmax(-1) != fused.argmax(-1)).sum()),
            "dflash2/max_score_difference": (torch_ops[finite] - fused[finite]).abs().max().item()}


def compare_engine(workdir: str) -> dict[str, float]:
    """Greedy tokens of the DFlash chain and of DDTree (Triton attention and tree kernels on) against
    plain decoding, batch 3: the number of differing tokens."""
    from flashtree import LLM, SamplingParams

    pair = tiny_dflash2_pair(workdir + "/engine", vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    prompts = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]]
    common = {"device": "cpu", "triton_attention": True, "triton_tree": True, "adaptive_spec": False,
              "max_running": 4, "max_context": 64}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(pair.target), **common).generate(prompts, params)]
    diffs = {}
    for spec, budget in (("dflash", None), ("ddtree", 6)):
        llm = LLM(str(pair.target), spec=spec, draft=str(pair.drafter), budget=budget, **common)
        assert llm.engine.proposer.runner.drafter.fused_kernels
        got = [o.token_ids for o in llm.generate(prompts, params)]
        diffs[f"engine/{spec}_tokens_differing_from_plain"] = float(
            sum(a != b for x, y in zip(got, plain) for a, b in zip(x, y)))
    return diffs


if __name__ == "__main__":
    print(json.dumps(compare_drafter(sys.argv[1]) | compare_engine(sys.argv[1])))
