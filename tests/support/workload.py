"""The shared workload of the tiny-pair engine tests (DFlash, DDTree, adaptive speculation, queued
rounds, padding, draft vocabularies): the pair's vocabulary and block size, prompts of different
lengths, engine limits, and per-row stop conditions."""

from __future__ import annotations

from flashtree import SamplingParams

VOCAB = 24
BLOCK = 4
PROMPTS = [[1, 5, 7], list(range(3, 20)), [9], [4, 4, 8, 8, 2, 2], list(range(20, 4, -1)) * 2,
           [11, 3], [6, 7, 8, 9, 10, 11, 12, 13, 14], [23, 0, 23, 0, 5]]
ENGINE = dict(max_running=8, max_context=96, prefill_chunk=8, adaptive_spec=False)  # fixed method (tau checks)

# the sampling checks: a smaller vocabulary, so the first tokens' exact distribution is small
SAMPLE_VOCAB = 8
SAMPLE_PROMPT = [1, 2, 3, 4]
SAMPLE_ENGINE = dict(max_running=64, max_context=16, prefill_chunk=8, adaptive_spec=False)


def mixed_params(plain, prompts) -> list[SamplingParams]:
    """Per row: a max_tokens limit, a stop token id seen in the free-running output, or the
    tokenizer's default stop tokens (eos, end of turn)."""
    free = plain.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=7 + 2 * i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(out.token_ids[5 + i % 4],)))
        else:
            params.append(SamplingParams(max_tokens=20))
    return params
