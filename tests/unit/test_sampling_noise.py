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


def test_rows_sampled_in_groups_choose_what_one_group_chooses(monkeypatch):
    """A wide forward is sampled a few rows at a time (bounded memory): every row's choice is the one
    it gets when all rows are sampled together, with temperatures, top-k and top-p per row and greedy rows."""
    import flashtree.sampling as sampling_module

    gen = torch.Generator().manual_seed(3)
    rows, positions, vocab = 7, 5, 301
    logits = torch.randn(rows, positions, vocab, generator=gen) * 3
    tensors = SamplingTensors(torch.tensor([0.7, 1.0, 0.0, 1.3, 0.5, 1.0, 2.0]),
                              torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.8]),
                              torch.tensor([0, 0, 0, 40, 5, 17, 0]), torch.arange(rows) * 7919, True, True)
    out_index = torch.arange(positions).expand(rows, -1) + torch.arange(rows)[:, None]
    together = choose_tokens(logits, tensors, out_index)
    for group in (1, 2, 3):
        monkeypatch.setattr(sampling_module, "SAMPLE_CHUNK_ELEMENTS", group * positions * vocab)
        assert torch.equal(choose_tokens(logits, tensors, out_index), together)
    assert torch.equal(together[2], logits[2].argmax(-1))  # the greedy row
    assert len(set(together[[0, 1, 3, 4, 5, 6]].flatten().tolist())) > 6  # the others sampled


def test_log_probabilities_in_row_groups_equal_one_group(monkeypatch):
    """token_logprobs takes rows a few at a time (bounded memory), reading each row's positions itself: the
    values equal those of the whole forward at once, gathered first."""
    import flashtree.sampling as sampling_module
    from flashtree.sampling import token_logprobs

    gen = torch.Generator().manual_seed(5)
    rows, nodes, path, vocab = 6, 9, 4, 211
    logits = torch.randn(rows, nodes, vocab, generator=gen) * 4
    positions = torch.randint(0, nodes, (rows, path), generator=gen)
    chosen = torch.randint(0, vocab, (rows, path), generator=gen)
    gathered = logits.gather(1, positions[:, :, None].expand(-1, -1, vocab))  # [B, P, V]
    logp = torch.log_softmax(gathered, dim=-1)
    whole = token_logprobs(gathered, chosen, 5)
    assert torch.equal(whole.chosen, logp.gather(-1, chosen[..., None])[..., 0])
    for group in (1, 2, 4, rows):
        monkeypatch.setattr(sampling_module, "SAMPLE_CHUNK_ELEMENTS", group * path * vocab)
        for got in (token_logprobs(logits, chosen, 5, positions=positions), token_logprobs(gathered, chosen, 5)):
            assert all(torch.equal(a, b) for a, b in zip(got, whole))
