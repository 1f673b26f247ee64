"""Per-row budgets stay lossless: rounds whose rows verify different numbers of nodes (0 = a plain
step for the row, 1, the round's full count, and the policy's own allotment) commit exactly plain
decoding's tokens (greedy, fp32, CPU) and, sampled, plain's seeded tokens (the target's
distribution), with the verify forward's rows packed (the default) or padded to the widest row; the
adaptive default stays lossless with its allotment on."""

from __future__ import annotations

import pytest
import torch

import flashtree.engine.round as round_module
from flashtree import LLM, SamplingParams
from flashtree.policy.row_budgets import allot_budgets
from tests.dflash_helpers import (  # noqa: F401 (one_thread: a fixture)
    assert_first_tokens_match_target,
    one_thread,
    sample_first_tokens,
    tiny_pair,
)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, SAMPLE_ENGINE, SAMPLE_PROMPT, VOCAB, mixed_params

BUDGET = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("row_budgets"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


class RotatingBudgets:
    """An allotment that gives the rows of each round budgets 0, 1, the full count, 2, ... (shifted
    by one row every round), and records every round's budgets."""

    def __init__(self):
        self.rounds: list[list[int]] = []

    def __call__(self, ranked, caps, cost, live, padded=False):
        rows = caps.shape[0]
        full = ranked.shape[1]
        pattern = torch.tensor([0, 1, full, 2])
        shift = len(self.rounds)
        budgets = pattern[(torch.arange(rows) + shift) % 4]
        budgets = torch.minimum(budgets, caps) * live
        self.rounds.append(budgets.tolist())
        return budgets


def with_allotment(llm: LLM, monkeypatch, rule=None, costs=None) -> None:
    """Turn the per-row allotment on for ``llm``'s (fixed-budget) engine: the policy offers a cost
    curve (flat by default) and ``rule`` replaces the allotment function."""
    monkeypatch.setattr(llm.engine.policy, "round_costs",
                        costs or (lambda rows, nodes: [1.0] * (rows * (nodes + 1) + 1)), raising=False)
    if rule is not None:
        monkeypatch.setattr(round_module, "allot_budgets", rule)


@pytest.fixture(params=[None, False, True], ids=["packed", "padded", "fixed-packed"])
def ddtree(pair, request, monkeypatch):
    """A DDTree engine whose allotted rounds verify packed rows (or padded ones, or fixed packed totals of
    rows x (budget + 1) from trees of up to the budget), checked to do so."""
    packings = []
    real = round_module.pack_rows
    monkeypatch.setattr(round_module, "pack_rows", lambda *args: packings.append(args[2]) or real(*args))
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, packed_verify=request.param,
              **ENGINE)
    llm.packed_totals = packings
    yield llm
    assert bool(packings) == (request.param is not False)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_mixed_budgets_in_one_round_equal_plain(plain, ddtree, monkeypatch, rows):
    rule = RotatingBudgets()
    with_allotment(ddtree, monkeypatch, rule)
    prompts = {1: PROMPTS[4:5], 3: [PROMPTS[i] for i in (0, 2, 3)], 8: PROMPTS}[rows]
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    params = mixed_params(plain, prompts) if rows == 8 else [long] * rows  # (8: per-row stop conditions)
    got = ddtree.generate(prompts, params)
    for ref, out in zip(plain.generate(prompts, params), got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
    seen = {b for budgets in rule.rounds for b in budgets}
    assert {0, 1, BUDGET} <= seen, seen
    if rows > 1:
        assert any(len(set(budgets)) >= 3 for budgets in rule.rounds), rule.rounds  # 0, 1, the full count together
    sizes = [size for out in got for size in out.tree_sizes]
    if ddtree.engine.runner.packed:  # (fixed totals: a round's nodes past its total are not verified)
        assert ddtree.packed_totals and all(total % (BUDGET + 1) == 0 for total in ddtree.packed_totals)
    else:
        assert set(sizes) <= {0, 1, 2, BUDGET} and 0 in sizes and BUDGET in sizes


@pytest.mark.parametrize("ddtree", [None, False], ids=["packed", "padded"], indirect=True)  # (fixed packed rounds
@pytest.mark.parametrize("rows", [3, 8])  # allot up to their total, by no cost curve)
def test_the_policy_allotment_in_the_ragged_layout_equals_plain(plain, ddtree, monkeypatch, rows):
    """The real allotment, ragged layout (rows keep different counts), a steep cost curve."""
    made = []

    def ragged(ranked, caps, cost, live, padded=False):
        made.append(allot_budgets(ranked, caps, cost, live, padded=False))
        return made[-1]

    with_allotment(ddtree, monkeypatch, ragged,
                   costs=lambda rows, nodes: [1.0 + 0.15 * t / rows for t in range(rows * (nodes + 1) + 1)])
    prompts = PROMPTS[:rows]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = ddtree.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    assert any(len(set(budgets.tolist())) > 1 for budgets in made)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("row_budgets_small"), vocab=8, block_size=BLOCK, tokenizer=False)
    plain = LLM(str(pair.target), **SAMPLE_ENGINE)
    return pair, plain


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_seeded_sampling_with_mixed_budgets_equals_plain(small, monkeypatch, rows):
    """Keyed sampling: the same seed gives the same tokens under every method, here with rows of one
    round verifying 0, 1, 2 or all of their nodes."""
    pair, plain = small
    ddtree = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, **SAMPLE_ENGINE)
    rule = RotatingBudgets()
    with_allotment(ddtree, monkeypatch, rule)
    prompts = [SAMPLE_PROMPT, [5, 6], [7] * 9]
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)] * 8)][:rows * 3]
    many = [prompts[i % 3] for i in range(len(params))]
    got = ddtree.generate(many, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(many, params)]
    assert {0, 1, BUDGET} <= {b for budgets in rule.rounds for b in budgets}


def test_sampled_tokens_with_mixed_budgets_follow_the_target(small, monkeypatch):
    """3000 seeded requests in rounds whose rows keep 0, 1, 2 or all of their nodes: the first three
    tokens follow the target's exact distribution (chi-square)."""
    pair, _ = small
    ddtree = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, **SAMPLE_ENGINE)
    rule = RotatingBudgets()
    with_allotment(ddtree, monkeypatch, rule)
    samples = sample_first_tokens(ddtree, SAMPLE_PROMPT, range(3000), temperature=1.0)
    assert_first_tokens_match_target(samples, pair.hf, SAMPLE_PROMPT, temperature=1.0)
    assert any(len(set(budgets)) >= 3 for budgets in rule.rounds)


@pytest.mark.parametrize("packed_verify", [None, True])
def test_the_adaptive_default_allots_and_stays_lossless(pair, plain, monkeypatch, packed_verify):
    """The adaptive policy (the default) with its own cost curve, or with fixed packed rounds (each option of n
    nodes a total of rows x (n + 1) tokens from trees of up to 4n: rows take unequal shares): the allotment runs
    in its drafted rounds and the tokens equal plain decoding's."""
    calls = []
    real = round_module.allot_budgets

    def spy(ranked, caps, cost, *args, **kwargs):
        calls.append((real(ranked, caps, cost, *args, **kwargs), cost.numel() - 1))  # (budgets, the round's tokens)
        return calls[-1][0]

    monkeypatch.setattr(round_module, "allot_budgets", spy)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, packed_verify=packed_verify,
              **{**ENGINE, "adaptive_spec": True})
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    drafted = sum(n for nodes, n in llm.engine.rounds_by_nodes.items() if nodes)
    assert drafted and calls, (dict(llm.engine.rounds_by_nodes), len(calls))
    if packed_verify:  # a round of n nodes a row verifies rows x (n + 1) tokens: some row took more than n
        assert any(int(budgets.max()) > tokens // len(budgets) - 1 for budgets, tokens in calls), calls[:4]


def test_narrowed_rounds_keep_logprobs_penalties_and_traces(pair, plain, monkeypatch, tmp_path):
    """Rounds with per-row budgets on a CPU (narrowed to their widest row; packed too where no penalty adjusts
    the logits) with per-token log-probabilities, a repetition penalty and a tree trace: the same tokens and
    log-probabilities as plain decoding, and every traced tree holds its row's nodes only."""
    import json

    trace = tmp_path / "trees.jsonl"
    packings = []
    real = round_module.pack_rows
    monkeypatch.setattr(round_module, "pack_rows", lambda *args: packings.append(1) or real(*args))
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, trace_trees=str(trace),
              **ENGINE)
    with_allotment(llm, monkeypatch, RotatingBudgets())
    prompts = [PROMPTS[i] for i in (0, 2, 3)]
    for params in (SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, repetition_penalty=1.3),
                   SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)):  # (packed: no penalty)
        got, want = llm.generate(prompts, params), plain.generate(prompts, params)
        for out, ref in zip(got, want):
            assert out.token_ids == ref.token_ids
            assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                                        abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in out.logprobs] == [[t for t, _ in lp.top] for lp in ref.logprobs]
    llm.engine.close_traces()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records and {len(r["tokens"]) - 1 for r in records} >= {0, 1, BUDGET}, records[:3]
    assert packings  # (the second pass's rounds)
