"""The sampler's keyed noise stays strictly inside (0, 1): a uniform of exactly 1.0 gives a Gumbel
noise of +inf, which would pick its token whatever its probability (a masked one included)."""

import torch

from flashtree.sampling import (
    SamplingTensors,
    choose_tokens,
    keyed_uniform,
    unit_interval,
)


def test_extreme_bits_stay_inside_the_open_interval():
    bits = torch.tensor([-1, 0, (1 << 63) - 1, -(1 << 63), (1 << 41) - 1], dtype=torch.long)
    values = unit_interval(bits)
    assert values.dtype == torch.float32
    assert bool((values > 0).all()) and bool((values < 1).all())
    assert torch.isfinite(-torch.log(-torch.log(values))).all()


def test_keyed_noise_is_finite_and_a_masked_token_is_never_sampled():
    seeds = torch.arange(64)
    uniform = keyed_uniform(seeds, torch.arange(64)[:, None].expand(-1, 16), 4096)  # [64, 16, 4096]
    assert bool((uniform > 0).all()) and bool((uniform < 1).all())
    logits = torch.full((64, 16, 4096), float("-inf"))
    logits[..., 7] = 0.0  # only token 7 allowed
    tensors = SamplingTensors(torch.ones(64), torch.ones(64), torch.zeros(64, dtype=torch.long), seeds, True, False)
    assert bool((choose_tokens(logits, tensors, torch.arange(16).expand(64, -1)) == 7).all())
