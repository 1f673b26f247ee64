"""The exact mode end to end on a tiny random pair: plain decoding, the DFlash chain and DDTree give the same
greedy tokens, each prompt gets the same tokens alone and in a batch (beside other prompts and beside a copy
of itself), and plain decoding gives the same tokens pass after pass. Run on CUDA in float32 and bfloat16 by
tests/gpu/test_exact_mode.py, and as ``python -m tests.support.exact_mode_checks WORKDIR`` under
``TRITON_INTERPRET=1`` on CPU tensors (float32) by tests/integration/test_exact_attention.py; returns (prints)
counts of differing token lists, all 0 when the mode holds (also with prefix caching: prompts whose whole pages a
second pass finds cached get the uncached tokens and log-probabilities bit for bit). ``methods_over_many_tokens``:
DFlash and DDTree-16 / 64 / 256 against plain decoding over 4,096 new tokens at a batch size (issue #29's long
check)."""

from __future__ import annotations

import json
import sys

EXACT_FAMILIES = ("qwen3_qknorm",)  # the tiny families whose head_dim (16) the exact attention takes
PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4], [3, 14, 15, 9, 2, 6]]  # the last: a copy


def _llm(pair, spec: str, device: str, dtype: str, max_running: int, budget: int = 6, max_context: int = 64,
         prefix_caching: bool = False):
    from flashtree import LLM

    return LLM(str(pair.target), spec=spec, draft=str(pair.drafter) if spec != "none" else None, budget=budget,
               device=device, dtype=dtype, exact=True, adaptive_spec=False, max_running=max_running,
               max_context=max_context, prefix_caching=prefix_caching)


def _random_prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 2-39 ids from the tiny pair's 64-token vocabulary (ids 1-63), drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def compare_exact_engine(device: str, workdir: str, dtype: str = "float32", max_tokens: int = 16,
                         specs: tuple[str, ...] = ("dflash", "ddtree")) -> dict[str, float]:
    from flashtree import SamplingParams
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(workdir + "/exact", vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = _llm(pair, "none", device, dtype, max_running=4)
    assert plain.engine.model.kernels.EXACT, "the exact backend did not switch on"
    together = [o.token_ids for o in plain.generate(PROMPTS, params)]
    again = [o.token_ids for o in plain.generate(PROMPTS, params)]
    alone = [plain.generate([p], params)[0].token_ids for p in PROMPTS[:2]]
    diffs = {"plain/pass_to_pass": sum(a != b for a, b in zip(together, again)),
             "plain/alone_vs_batch": sum(a != b for a, b in zip(together, alone)),
             "plain/copies_in_one_batch": float(together[0] != together[3]),
             "plain/prefix_cached_vs_uncached": prefix_cached_differences(pair, plain, max_tokens, device, dtype)}
    for spec in specs:
        llm = _llm(pair, spec, device, dtype, max_running=4)
        batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
        single = llm.generate([PROMPTS[2]], params)[0].token_ids
        diffs[f"{spec}/vs_plain_batch_4"] = sum(a != b for a, b in zip(batched, together))
        diffs[f"{spec}/vs_plain_batch_1"] = float(single != together[2])
    return {k: float(v) for k, v in diffs.items()}


def prefix_cached_differences(pair, uncached, max_tokens: int, device: str, dtype: str) -> float:
    """Prompts of 20 and 37 ids (one and two whole 16-entry pages) decoded twice by an engine with prefix caching:
    the prompts whose second pass, which finds their whole pages cached and prefills only the rest, gives other
    tokens or other log-probability bits than ``uncached`` (the exact mode's products and attention do not depend
    on the chunk; the fast CPU path's log-probabilities differ here)."""
    from flashtree import SamplingParams

    prompts = [(_random_prompts(1, seed)[0] * 37)[:length] for seed, length in ((5, 20), (6, 37))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)

    def decoded(llm):
        return [(o.token_ids, [entry.logprob for entry in o.logprobs]) for o in llm.generate(prompts, params)]

    expected = decoded(uncached)
    cached = _llm(pair, "none", device, dtype, max_running=2, prefix_caching=True)
    decoded(cached)
    return float(sum(got != want for got, want in zip(decoded(cached), expected)))


def methods_over_many_tokens(device: str, workdir: str, dtype: str, batch: int, tokens: int = 4096,
                             methods: tuple[str, ...] = ("dflash", "ddtree:16", "ddtree:64", "ddtree:256")
                             ) -> dict[str, float]:
    """Exact-mode greedy decoding of ``batch`` distinct prompts, ``tokens`` new tokens in all (``tokens // batch``
    each), by plain decoding and by each method (``dflash`` or ``ddtree:BUDGET``): the token lists of each method
    that differ from plain's, and the tokens compared."""
    from flashtree import SamplingParams
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(workdir + "/many", vocab=64, block_size=5, drafter_layers=1, tokenizer=False)
    prompts = _random_prompts(batch, seed=1000 + batch)
    each = tokens // batch
    params = SamplingParams(max_tokens=each, ignore_eos=True)
    context = max(len(p) for p in prompts) + each + 8
    plain = [o.token_ids for o in _llm(pair, "none", device, dtype, batch, max_context=context).generate(prompts, params)]
    diffs = {"tokens_compared": float(sum(len(t) for t in plain))}
    for method in methods:
        spec, _, budget = method.partition(":")
        llm = _llm(pair, spec, device, dtype, batch, budget=int(budget or 6), max_context=context)
        diffs[method] = float(sum(o.token_ids != t for o, t in zip(llm.generate(prompts, params), plain)))
    return diffs


def plain_repeatability(device: str, workdir: str, dtype: str, batch: int, max_tokens: int = 24) -> dict[str, float]:
    """Exact-mode plain decoding of ``batch`` prompts (each in two copies when batch > 1) twice on one engine:
    token lists differing pass to pass, copy from copy, and for two prompts decoded alone."""
    from flashtree import SamplingParams
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(workdir + "/repeat", vocab=64, block_size=5, drafter_layers=1, tokenizer=False)
    distinct = _random_prompts(max(1, batch // 2), seed=batch)
    prompts = (distinct * 2)[:batch]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm = _llm(pair, "none", device, dtype, max_running=batch)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    second = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts[:2]]
    half = len(distinct)
    return {"pass_to_pass": float(sum(a != b for a, b in zip(first, second))),
            "copies": float(sum(first[i] != first[i + half] for i in range(batch - half))),
            "alone_vs_batch": float(sum(a != b for a, b in zip(alone, first)))}


if __name__ == "__main__":  # the interpreter is slow: fewer tokens, DDTree only (the chain is a causal tree)
    import torch

    from tests.support.kernel_checks import compare

    print(json.dumps({"tokens_differing": compare_exact_engine("cpu", sys.argv[1], max_tokens=6, specs=("ddtree",)),
                      "vs_unfused": compare("cpu", torch.float32, backend="exact", families=EXACT_FAMILIES)}))
