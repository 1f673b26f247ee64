"""DDTree decoding is lossless at every budget: greedy tokens equal plain greedy decoding for
batches with rows of different lengths and stop conditions; big trees accept more than one
token per round; acceptance grows with the budget; a copying drafter reaches full blocks;
sampled tokens follow the target's distribution (and a wrong acceptance rule is caught)."""

from __future__ import annotations

import json

import pytest
import torch

import flashtree.engine.round as round_module
from flashtree import LLM, SamplingParams
from flashtree.cli import main as cli_main
from flashtree.speculative.ddtree import DDTreeProposer
from flashtree.speculative.tree import ROOT
from tests.dflash_helpers import (
    assert_first_tokens_match_target,
    chi_square,
    chi_square_critical,
    first_tokens_distribution,
    one_thread,
    sample_first_tokens,
    tiny_pair,
    use_copying_proposer,
)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, SAMPLE_ENGINE, SAMPLE_PROMPT, VOCAB, mixed_params

BUDGETS = [1, 4, 16, 64, 256]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("ddtree"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


@pytest.fixture(scope="module")
def ddtree(pair):
    """budget -> LLM, built on first use."""
    engines: dict[int, LLM] = {}

    def get(budget: int) -> LLM:
        if budget not in engines:
            engines[budget] = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=budget, **ENGINE)
        return engines[budget]

    return get


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_equals_plain(plain, ddtree, budget, rows):
    prompts = PROMPTS[:rows] if rows > 1 else PROMPTS[4:5]
    params = mixed_params(plain, prompts)
    llm = ddtree(budget)
    assert isinstance(llm.engine.proposer, DDTreeProposer) and llm.engine.proposer.max_nodes == budget
    expected = plain.generate(prompts, params)
    got = llm.generate(prompts, params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert all(size <= budget for size in out.tree_sizes)


@pytest.mark.parametrize("budget, least_mean", [(64, 1.3), (256, 1.6)])
def test_big_trees_accept_more_than_one_token(ddtree, budget, least_mean):
    """With 24 tokens, a big tree holds most depth-1 tokens, so most rounds accept a draft."""
    outs = ddtree(budget).generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    lengths = [n for o in outs for n in o.acceptance_lengths]
    assert max(lengths) >= 2 and sum(lengths) / len(lengths) >= least_mean


def first_round_acceptance(llm: LLM, prompts, budgets) -> dict[tuple[int, int], int]:
    """(prompt index, budget) -> acceptance length of the request's first round, all requests
    in one batch with per-request budgets."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    requests = {(i, b): llm.engine.add_request(p, params, budget=b) for i, p in enumerate(prompts) for b in budgets}
    llm.engine.run_until_done(list(requests.values()))
    return {key: req.stats.acceptance_lengths[0] for key, req in requests.items()}


def test_acceptance_grows_with_budget(ddtree):
    """The budget-B tree is inside the budget-2B tree (same drafter, same inputs), so the first
    round never accepts less with a bigger budget."""
    budgets = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    first = first_round_acceptance(ddtree(256), PROMPTS, budgets)
    for i in range(len(PROMPTS)):
        row = [first[i, b] for b in budgets]
        assert row == sorted(row), f"prompt {i}: first-round acceptance {row} for budgets {budgets}"
        assert row[0] == 1  # budget 0: the root alone
    assert any(first[i, 256] > first[i, 1] for i in range(len(PROMPTS)))
    separate = {b: ddtree(b).generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)) for b in BUDGETS}
    for i in range(len(PROMPTS)):
        row = [separate[b][i].acceptance_lengths[0] for b in BUDGETS]
        assert row == sorted(row) and row == [first[i, b] for b in BUDGETS]


@pytest.mark.parametrize("budget", [3, 8, 40])
def test_copying_drafter_reaches_full_blocks(pair, plain, monkeypatch, budget):
    made = use_copying_proposer(monkeypatch, depth=BLOCK - 1, budget=budget)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=budget, **ENGINE)
    made[-1].attach(llm.engine)
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    got = llm.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS[:4], params)]
    assert all(o.acceptance_lengths == [BLOCK] * 3 for o in got)  # the copied path is the tree's best
    assert all(size == budget for o in got for size in o.tree_sizes)


def test_run_stats_and_cli_json(pair, ddtree, tmp_path, capsys):
    llm = ddtree(16)
    llm.stats(reset=True)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10, ignore_eos=True))
    stats = llm.stats()
    lengths = [n for o in outs for n in o.acceptance_lengths]
    assert stats.requests == 3 and stats.generated_tokens == 30 and stats.rounds == len(lengths)
    assert stats.committed_tokens == sum(lengths) and stats.mean_acceptance_length == sum(lengths) / len(lengths)
    assert sum(stats.acceptance_histogram.values()) == stats.rounds and 0 < stats.mean_tree_size <= 16
    assert {"draft", "verify", "commit"} <= set(stats.stage_seconds)
    assert set(stats.rounds_by_nodes) == {16} and sum(stats.rounds_by_nodes.values()) <= stats.rounds  # fixed
    assert all(v >= 0 for v in stats.stage_seconds.values())
    assert llm.stats(reset=True).requests == 3 and llm.stats().requests == 0
    argv = ["generate", "--model", str(pair.target), "--spec", "ddtree", "--draft", str(pair.drafter), "--budget", "8",
            "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--max-tokens", "9", "--ignore-eos", "--json",
            "--device", "cpu"]
    assert cli_main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"token_ids", "text", "acceptance_lengths"} <= set(line)
    same = ddtree(8).generate([PROMPTS[1]], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert line["token_ids"] == same.token_ids
    assert sum(line["acceptance_lengths"]) >= 8


# ---------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("ddtree_small"), vocab=8, block_size=BLOCK, tokenizer=False)
    plain = LLM(str(pair.target), **SAMPLE_ENGINE)
    ddtree = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=16, **SAMPLE_ENGINE)
    return pair, plain, ddtree


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.9}])
def test_sampled_tokens_follow_the_target(small, filters):
    pair, _, ddtree = small
    samples = sample_first_tokens(ddtree, SAMPLE_PROMPT, range(3000), temperature=1.0, **filters)
    assert_first_tokens_match_target(samples, pair.hf, SAMPLE_PROMPT, temperature=1.0, **filters)
    assert ddtree.stats().mean_acceptance_length > 1.3  # the 16-node tree holds every depth-1 token


def test_seeded_sampling_equals_plain(small):
    _, plain, ddtree = small
    prompts = [SAMPLE_PROMPT, [5, 6], [7] * 9]
    params = [SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)] * 20)]
    many = [prompts[i % 3] for i in range(len(params))]
    assert [o.token_ids for o in ddtree.generate(many, params)] == [o.token_ids for o in plain.generate(many, params)]


def test_chi_square_catches_a_wrong_acceptance_rule(small, monkeypatch):
    """Guard on the test's power: a walk that always accepts the first depth-1 node (the
    drafter's top token) instead of checking the target's sample must fail the check."""
    pair, _, ddtree = small
    real_walk = round_module.accept_walk

    def wrong_walk(tree, choice, max_depth=None, **options):
        first_child = (tree.parents == ROOT) & tree.valid
        first_child[:, ROOT] = False
        forced = tree.tokens.gather(1, first_child.long().argmax(1, keepdim=True))  # [B, 1]
        return real_walk(tree, torch.cat([forced, choice[:, 1:]], dim=1), max_depth, **options)

    monkeypatch.setattr(round_module, "accept_walk", wrong_walk)
    samples = sample_first_tokens(ddtree, SAMPLE_PROMPT, range(1000), temperature=1.0)
    joint, _ = first_tokens_distribution(pair.hf, SAMPLE_PROMPT)
    counts = torch.bincount(samples[:, 0] * 8 + samples[:, 1], minlength=64)
    stat, df = chi_square(counts, joint)
    assert stat > 10 * chi_square_critical(df)


def test_trace_trees_records_each_round(tmp_path):
    """--trace-trees: per request and round, the verified tree and the accepted path."""
    import json

    from flashtree import LLM, SamplingParams
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=24, block_size=4)
    trace = tmp_path / "trees.jsonl"
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, max_context=128,
              trace_trees=str(trace), adaptive_spec=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == out.rounds
    for line, accepted in zip(lines, out.acceptance_lengths):
        assert line["parents"][0] == -1 and len(line["tokens"]) == len(line["parents"]) == 9
        path = line["accepted_path"]
        assert path[0] == 0 and len(path) == accepted
        assert all(line["parents"][child] == parent for parent, child in zip(path, path[1:]))
    # the output is each round's root (bonus) followed by that round's accepted drafts
    rebuilt = [t for line in lines for t in [line["tokens"][n] for n in line["accepted_path"]]]
    # (max_tokens may cut the last round short; otherwise its next bonus is the one extra token)
    shared = min(len(rebuilt), len(out.token_ids))
    assert out.token_ids[:shared] == rebuilt[:shared] and shared >= len(out.token_ids) - 1


def test_trace_trees_observe_and_change_nothing(tmp_path):
    """A tree trace leaves the engine's paths as they are (graphed rounds, queued plain rounds, the
    plain fast path): the same tokens and acceptance as without the trace, and the same trace lines
    with rounds graphed (a pass-through graph cache: keys, padded rows, a capture's warm-up run) and
    queued as with rounds run one by one; plain rounds trace their root-only tree."""
    from tests.dflash_helpers import PassThroughGraphs, ScriptedNodes, tiny_pair
    from tests.support.traces import by_request_order

    pair = tiny_pair(tmp_path, vocab=24, block_size=4)
    prompts = [[1, 2, 3], list(range(2, 14)), [7] * 5]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(3)]

    def run(trace: str | None, graphed: bool, queued: bool):
        llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, max_context=128, max_running=4,
                  trace_trees=trace, adaptive_spec=False, queue_plain_rounds=queued)
        if graphed:
            llm.engine.runner.graphs = PassThroughGraphs()
        llm.engine.policy = ScriptedNodes([0, 0, 8, 0, 4, 0, 0])  # plain stretches: some of them queued
        outs = [(o.token_ids, o.acceptance_lengths) for o in llm.generate(prompts, params)]
        return outs, llm.engine.queued_rounds

    untraced, _ = run(None, graphed=False, queued=False)
    traces = {}
    for graphed, queued in ((False, False), (True, False), (True, True)):
        path = tmp_path / f"trees_{graphed}_{queued}.jsonl"
        outs, queued_rounds = run(str(path), graphed, queued)
        assert outs == untraced
        assert (queued_rounds > 0) == queued
        traces[graphed, queued] = by_request_order([json.loads(line) for line in path.read_text().splitlines()])
    assert traces[True, False] == traces[False, False] == traces[True, True]
    lines = traces[False, False]
    assert len(lines) == sum(len(lengths) for _, lengths in untraced)
    plain = [line for line in lines if len(line["tokens"]) == 1]
    assert plain and all(line["parents"] == [-1] and line["accepted_path"] == [0] for line in plain)
