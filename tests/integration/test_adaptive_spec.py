"""Adaptive speculation in the engine: whatever node counts the policy picks per round (plain
rounds of 0 nodes included), greedy and seeded outputs equal plain decoding; plain rounds keep
the drafter's context cache in sync; a drafter that never matches drives the policy to plain
rounds and one that always matches keeps it on drafted rounds."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import flashtree.engine.engine as engine_module
from flashtree import LLM, SamplingParams
from flashtree.config import PolicyConfig
from flashtree.policy import FixedNodes, rows_bucket
from flashtree.policy.base import round_fits
from flashtree.speculative.plain import PlainProposer
from flashtree.speculative.tree import build_tree, chain_tree
from tests.dflash_helpers import PassThroughGraphs, one_thread, tiny_pair
from tests.support.clocks import use_read_count_clock
from tests.support.workload import BLOCK, PROMPTS, VOCAB, mixed_params

BUDGET = 16  # DDTree ladder (16, 8, 4, 0)
# The oracle drafts this deep (DFlash ladder (7, 0)): an always-matching draft then commits 8 tokens a
# round at about 4x a plain round's cost on this CPU's tiny pair, a clear win. With the drafter's
# block (3 deep: 4 tokens at 3.6x, since plain rounds skip the tree machinery) the choice was close
# enough for timing noise to decide it.
ORACLE_DEPTH = 7
ENGINE = dict(max_running=8, max_context=128, prefill_chunk=8)
SWITCHY = PolicyConfig(explore_rounds=1, probe_interval=3)  # switches node counts often


class ScriptedPolicy(FixedNodes):
    """Node counts from a fixed cycle (the policy interface, without measurements)."""

    def __init__(self, ladder, script):
        self.ladder, self.script, self.at = tuple(ladder), list(script), 0

    def choose(self, rows: int) -> int:
        self.at += 1
        return self.script[(self.at - 1) % len(self.script)]

    def settled_on_plain(self, rows: int) -> bool:
        """(Queued plain rounds: the script's next round is plain.)"""
        return self.script[self.at % len(self.script)] == 0


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("adaptive"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


def adaptive_llm(pair, method: str) -> LLM:
    """An adaptive LLM with the real (random) drafter and the SWITCHY policy."""
    return LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET, adaptive_spec=True,
               spec_policy=SWITCHY, **ENGINE)


@pytest.fixture(scope="module")
def adaptive(pair):
    """method -> adaptive_llm, built on first use and shared by the module's tests."""
    engines: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        if method not in engines:
            engines[method] = adaptive_llm(pair, method)
        return engines[method]

    return get


def switches_to_plain_and_back(tree_sizes: list[int]) -> bool:
    """A plain round (0 drafted nodes) followed later by a drafted round."""
    return 0 in tree_sizes and any(tree_sizes[tree_sizes.index(0):])


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_greedy_equals_plain_while_node_counts_switch(pair, plain, method, rows, monkeypatch):
    """Rows of different lengths and stop conditions, then 40 tokens each (enough rounds in one
    rows bucket for the policy to try every option and switch back and forth). A fresh engine:
    once a weak drafter's acceptance is known, later buckets skip trees that cannot beat plain.
    The engine's clock counts its reads (tests/support/clocks.py), so the choices the policy makes
    from round times are the same on every machine."""
    use_read_count_clock(monkeypatch)
    prompts = PROMPTS[:rows] if rows > 1 else PROMPTS[1:2]
    runs = [[SamplingParams(max_tokens=40, ignore_eos=True)] * rows]
    if rows > 1:
        runs.insert(0, mixed_params(plain, prompts))
    llm = adaptive_llm(pair, method)
    llm.stats(reset=True)
    got = []
    for params in runs:
        expected = plain.generate(prompts, params)
        got += llm.generate(prompts, params)
        for ref, out in zip(expected, got[-rows:]):
            assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
    ladder = llm.engine.policy.ladder
    assert set(llm.stats().rounds_by_nodes) == set(ladder)  # every option ran, plain included
    assert any(switches_to_plain_and_back(o.tree_sizes) for o in got)


@pytest.mark.parametrize("script", ["adaptive", "scripted"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_seeded_sampling_equals_plain(plain, adaptive, method, script, monkeypatch):
    """Keyed sampling noise makes sampled tokens independent of the round shapes: the policy's
    own choices, and a script that surely switches to plain rounds and back."""
    llm = adaptive(method)
    if script == "scripted":
        ladder = llm.engine.policy.ladder
        monkeypatch.setattr(llm.engine, "policy", ScriptedPolicy(ladder, [0, ladder[0], 0, 0, ladder[-2]]))
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[6]]
    params = [SamplingParams(max_tokens=16, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)] * 4)]
    many = [prompts[i % 3] for i in range(len(params))]
    got = llm.generate(many, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(many, params)]
    if script == "scripted":
        assert all(switches_to_plain_and_back(o.tree_sizes) for o in got)


# ---------------------------------------------------------------------------- drafter in sync

def drafter_context(llm: LLM, slot: int) -> tuple[int, torch.Tensor]:
    """(context length, its K/V ``[layers, 2, kv_heads, length, head_dim]``) of a drafter slot."""
    cache = llm.engine.proposer.runner.cache
    length = int(cache.lengths[slot])
    slots = torch.tensor([slot], device=cache.lengths.device)
    return length, torch.stack([torch.stack(cache.view(layer, slots, length))[:, 0] for layer in range(len(cache.k))])


@pytest.mark.parametrize("lag_capacity, graphed, queued", [(64, False, False), (2, False, False), (2, True, False),
                                                             (64, False, True), (4, True, True), (2, False, True)])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_plain_rounds_keep_the_drafter_in_sync(pair, method, lag_capacity, graphed, queued, monkeypatch):
    """After a mix of plain and drafted rounds, the drafter holds the context K/V of every
    committed token once it catches up: the same as a drafter that prefilled the whole committed
    text. Plain rounds defer the projection: the drafter lags by the trailing plain rounds (or
    by fewer, when the lag capacity forced a catch-up). ``graphed``: rounds and full-width
    catch-ups go through a pass-through graph cache (padded rows; a new key runs twice, as a
    capture's warm-up and replay do). ``queued``: plain rounds after plain rounds are queued
    before the round ahead is read (engine/overlap.py; the script's tenth round,
    never run, is drafted, so the ninth queues nothing behind it)."""
    import flashtree.speculative.drafter as proposer_module

    monkeypatch.setattr(proposer_module, "lag_capacity", lambda *_: lag_capacity)
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET, queue_plain_rounds=queued,
              **ENGINE)
    if graphed:
        llm.engine.runner.graphs = graphs = PassThroughGraphs()
    ladder = llm.engine.policy.ladder
    llm.engine.policy = ScriptedPolicy(ladder, [0, 0, ladder[0], 0, ladder[-2], ladder[0], 0, 0, 0, ladder[0]])
    reqs = [llm.engine.add_request(p, SamplingParams(max_tokens=100, ignore_eos=True)) for p in PROMPTS[:3]]
    for _ in range(10):  # a prefill step, then 9 rounds: the script once, ending in 3 plain rounds
        llm.engine.step()
    reference = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET,
                    **{**ENGINE, "prefill_chunk": 128})
    lags = []
    for req in reqs:
        assert not req.finished and 0 in req.stats.tree_sizes and max(req.stats.tree_sizes) > 0
        committed = req.prompt_ids + req.output_ids[:-1]  # the bonus token is not committed yet
        assert int(llm.engine.cache.lengths[req.slot]) == len(committed)
        trailing_plain = len(req.stats.tree_sizes) - len(rstrip_zeros(req.stats.tree_sizes))
        assert req.drafter_lag == ((trailing_plain - 1) % lag_capacity + 1 if trailing_plain else 0)
        lags.append(req.drafter_lag)
        drafter_cache = llm.engine.proposer.runner.cache
        assert int(drafter_cache.lengths[req.slot]) == len(committed) - req.drafter_lag
        llm.engine.proposer.runner.catch_up([req.slot], [len(committed) - req.drafter_lag], [req.drafter_lag])
        length, context = drafter_context(llm, req.slot)
        twin = reference.engine.add_request(committed, SamplingParams(max_tokens=2, ignore_eos=True))
        reference.engine.step()  # one prefill chunk holds the whole text
        if twin.drafter_lag:  # a prompt that fits the lag is deferred at prefill too
            reference.engine.proposer.runner.catch_up([twin.slot], [0], [twin.drafter_lag])  # (its whole prompt)
            twin.drafter_lag = 0
        ref_length, ref_context = drafter_context(reference, twin.slot)
        reference.engine.run_until_done([twin])
        assert length == ref_length == len(committed)
        torch.testing.assert_close(context, ref_context, atol=1e-4, rtol=1e-4)
    assert max(lags) >= min(2, lag_capacity - 1)  # the check above ran on a drafter that had deferred tokens
    # queued: rounds 8 and 9 (rounds 1 and 2 run beside the long prompt's prefill chunks, so nothing is queued then)
    assert llm.engine.queued_rounds == (2 if queued else 0), llm.engine.queued_rounds
    if graphed:
        assert any(key[0] == "catch_up" for key in graphs.keys)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_short_prompts_defer_the_drafter_at_prefill(pair, plain, method):
    """A prompt that fits one prefill chunk and the drafter's lag is not projected at prefill (the
    first token does not wait for the drafter): the drafter's context stays empty and the request's
    lag holds the prompt. A catch-up then gives the context that a prefill projecting at once gives
    (a prompt in two chunks), and the outputs are still plain decoding's."""
    prompt = PROMPTS[1]  # 17 tokens
    deferring = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET,
                    **{**ENGINE, "prefill_chunk": 32})
    chunked = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET,
                  **{**ENGINE, "prefill_chunk": 9})
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    req, twin = deferring.engine.add_request(prompt, params), chunked.engine.add_request(prompt, params)
    deferring.engine.step()  # the whole prompt
    chunked.engine.step(), chunked.engine.step()  # 9 + 8 tokens, each projected at once
    assert req.drafter_lag == len(prompt) and drafter_context(deferring, req.slot)[0] == 0
    assert twin.drafter_lag == 0
    deferring.engine.proposer.runner.catch_up([req.slot], [0], [req.drafter_lag])  # (its whole prompt)
    req.drafter_lag = 0
    (length, context), (twin_length, twin_context) = drafter_context(deferring, req.slot), drafter_context(chunked, twin.slot)
    assert length == twin_length == len(prompt)
    torch.testing.assert_close(context, twin_context, atol=1e-4, rtol=1e-4)
    deferring.engine.run_until_done([req]), chunked.engine.run_until_done([twin])
    many = [PROMPTS[i] for i in (0, 1, 3, 4, 6)] + [[i % 20 for i in range(40)]]  # deferred ones, one of two chunks
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(many)
    assert [o.token_ids for o in deferring.generate(many, params)] == [o.token_ids for o in plain.generate(many, params)]


class TimesKeepingPolicy(ScriptedPolicy):
    """A scripted policy that keeps the round times it is fed."""

    def __init__(self, ladder, script):
        super().__init__(ladder, script)
        self.seconds: list[float | None] = []

    def record(self, rows, nodes, seconds, acceptance) -> None:
        self.seconds.append(seconds)


def test_the_first_round_after_an_idle_pause_is_not_timed(pair, monkeypatch):
    """The engine feeds the policy every round's wall time except the first round after a pause of
    more than IDLE_GAP_S between engine steps (the first round of a server after a pause); rounds
    after a long prefill step are timed, and no timed round holds the pause. The engine's clock
    counts its reads (tests/support/clocks.py) and the pauses are on that clock: what is timed does
    not depend on how fast this machine runs a round."""
    clock = use_read_count_clock(monkeypatch)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, **ENGINE)
    policy = llm.engine.policy = TimesKeepingPolicy(llm.engine.policy.ladder, [0])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([PROMPTS[0]], [params])
    clock.sleep(2 * engine_module.IDLE_GAP_S)
    llm.generate([PROMPTS[1]], [params])
    first, second = policy.seconds[:5], policy.seconds[5:]
    assert len(first) == len(second) == 5  # 6 tokens: the first from the prefill, 5 rounds
    assert first[0] is None and second[0] is None  # the engine's first round, and the first after the pause
    assert all(s is not None and s < engine_module.IDLE_GAP_S for s in first[1:] + second[1:])
    slow_prefill = llm.engine.prefill

    def prefill_taking_a_while(*args, **kwargs):
        clock.sleep(2 * engine_module.IDLE_GAP_S)
        return slow_prefill(*args, **kwargs)

    llm.engine.prefill = prefill_taking_a_while  # a busy server: a long prefill between rounds
    reqs = [llm.engine.add_request(PROMPTS[0], params)]
    llm.engine.step(), llm.engine.step()  # its prefill, then a round
    reqs.append(llm.engine.add_request(PROMPTS[1], params))
    llm.engine.step()  # a round of the first request, then the second's long prefill
    llm.engine.step()  # a round right after that prefill step: timed
    assert policy.seconds[-1] is not None


def rstrip_zeros(sizes: list[int]) -> list[int]:
    while sizes and sizes[-1] == 0:
        sizes = sizes[:-1]
    return sizes


# ---------------------------------------------------------------------------- policy outcomes

class OracleProposer(PlainProposer):
    """A test double that drafts from the plain greedy continuation of each prompt: exactly
    (``match``), or always wrong (every drafted token differs from the target's, and a tree
    never holds the right one). Each draft pays ``delay`` seconds of the engine's clock
    (``pause``), like a drafter pass."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], chain: bool, match: bool, delay: float,
                 pause):
        super().__init__()
        self.continuations, self.chain, self.match, self.delay, self.pause = continuations, chain, match, delay, pause
        self.max_depth = ORACLE_DEPTH
        self.max_nodes = self.max_depth if chain else BUDGET
        self.engine = None

    def propose(self, rows, nodes: int, refine=None, allot=None):
        self.pause(self.delay)
        by_slot = {r.slot: r for r in self.engine.scheduler.active}
        drafts = []
        for slot in rows.slots.tolist():
            req = by_slot[slot]
            done = len(req.output_ids)
            # the bonus is output token done - 1; the drafts are the ones after it
            drafts.append(self.continuations[tuple(req.prompt_ids)][done:done + self.max_depth])
        right = torch.tensor(drafts)  # [B, L]: the target's next tokens after the bonus
        draft = right if self.match else (right + 1) % VOCAB
        if self.chain:
            return chain_tree(draft[:, :nodes])
        logits = torch.rand(*draft.shape, VOCAB, generator=torch.Generator().manual_seed(0))  # [B, L, V]
        logits = logits + 8.0 * torch.nn.functional.one_hot(draft, VOCAB)
        if not self.match:
            logits[:, 0].scatter_(1, right[:, :1], -30.0)  # far below every deeper prefix of the tree
        return build_tree(logits, rows.budgets, nodes, allot=allot)


class RecordingPolicy:
    """Wraps a policy and keeps its choices."""

    def __init__(self, policy):
        self.policy, self.ladder, self.chosen = policy, policy.ladder, []

    def choose(self, rows: int) -> int:
        self.chosen.append(self.policy.choose(rows))
        return self.chosen[-1]

    def __getattr__(self, name):  # everything else of the policy interface: the wrapped policy's
        return getattr(self.policy, name)


def run_with_oracle(pair, plain, monkeypatch, method: str, match: bool, runs_ahead: bool = False) -> Counter:
    """Rounds per node count after exploration, for 4 rows of 80 tokens decoded together
    (prompts within one prefill chunk) under the policy. ``runs_ahead``: the engine acts as on a
    device that runs ahead of the host (CUDA): the policy folds its held rounds during each round.
    The engine runs on a read-count clock (tests/support/clocks.py): a drafter that matches costs
    nothing more (its rounds cost what plain ones do); one that never matches pays 5 ms of that
    clock per draft, which makes its rounds dearer. The same round times on every machine."""
    prompts = [p for p in PROMPTS if len(p) <= ENGINE["prefill_chunk"]][:4]
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    long = plain.generate(prompts, SamplingParams(max_tokens=80 + ORACLE_DEPTH + 1, ignore_eos=True))
    continuations = {tuple(p): o.token_ids for p, o in zip(prompts, long)}
    made: list[OracleProposer] = []

    def factory(config, target, tokenizer):
        made.append(OracleProposer(continuations, chain=method == "dflash", match=match,
                                   delay=0.0 if match else 0.005, pause=clock.sleep))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_proposer", factory)
    clock = use_read_count_clock(monkeypatch)
    config = PolicyConfig(explore_rounds=1, probe_interval=10)
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET, spec_policy=config, **ENGINE)
    made[-1].engine = llm.engine
    llm.engine.runner.runs_ahead = runs_ahead
    policy = llm.engine.policy = RecordingPolicy(llm.engine.policy)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    # exploration, smaller options first: the first round of each option is not timed (a warm-up;
    # the engine's very first one also follows an idle engine), so an option runs twice, unless its
    # warm-up's acceptance (1: a drafter that never matches) shows it cannot beat plain rounds
    trees = sorted(n for n in policy.ladder if n)
    exploration = [n for n in [0, *trees] for _ in range(2)] if match else [0, 0, *trees]
    assert policy.chosen[:len(exploration)] == exploration, policy.chosen
    explore = len(exploration)
    return Counter(policy.chosen[explore:])


@pytest.mark.parametrize("runs_ahead", [False, True])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_never_matching_drafter_ends_on_plain_rounds(pair, plain, monkeypatch, method, runs_ahead):
    rounds = run_with_oracle(pair, plain, monkeypatch, method, match=False, runs_ahead=runs_ahead)
    assert rounds.get(0, 0) >= 0.8 * sum(rounds.values()), rounds


@pytest.mark.parametrize("runs_ahead", [False, True])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_always_matching_drafter_stays_on_drafted_rounds(pair, plain, monkeypatch, method, runs_ahead):
    rounds = run_with_oracle(pair, plain, monkeypatch, method, match=True, runs_ahead=runs_ahead)
    drafted = sum(c for n, c in rounds.items() if n >= ORACLE_DEPTH)  # nodes enough for the oracle's full depth
    assert drafted >= 0.8 * sum(rounds.values()), rounds


# ---------------------------------------------------------------------------- request budgets (engine)

def test_requests_asking_for_no_draft_run_plain_rounds(adaptive):
    llm = adaptive("ddtree")
    before = dict(llm.engine.rounds_by_nodes)
    reqs = [llm.engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True), budget=0) for p in PROMPTS[:2]]
    llm.engine.run_until_done(reqs)
    after = llm.engine.rounds_by_nodes
    assert {n for n in after if after[n] != before.get(n, 0)} == {0}
    assert all(r.stats.acceptance_lengths == [1] * 7 for r in reqs)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_round_token_bound_shrinks_fixed_rounds_and_keeps_the_tokens(pair, plain, method, tmp_path):
    """A fixed budget (adaptive off) under --max-round-tokens 24: while 5 rows run (bucket 8) neither the
    3-node chain (32 tokens) nor a 4-node tree (40) fits, so rounds are plain; as rows finish, smaller
    buckets verify what fits (4 rows: 4-node trees, 2 rows: 8, 1 row: 16). Every round (--trace-policy)
    stays within the bound, and greedy tokens equal plain decoding's."""
    import json

    trace = tmp_path / "policy.jsonl"
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET, adaptive_spec=False,
              max_round_tokens=24, trace_policy=str(trace), **ENGINE)
    params = [SamplingParams(max_tokens=8 + 6 * i, ignore_eos=True) for i in range(5)]
    expected = plain.generate(PROMPTS[:5], params)
    got = llm.generate(PROMPTS[:5], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    rounds = [(json.loads(line)["rows"], json.loads(line)["nodes"]) for line in trace.read_text().splitlines()]
    assert all(round_fits(rows_bucket(rows), nodes, 24) for rows, nodes in rounds)
    assert {nodes for rows, nodes in rounds if rows > 4} == {0}
    assert any(nodes for _, nodes in rounds)  # fewer rows: drafted rounds again


def test_policy_trace_has_one_line_per_batched_round(pair, tmp_path):
    """``--trace-policy``: one JSON line per batched round with the choice, its time and the
    policy's estimates for the round's bucket (ladder order)."""
    import json

    trace = tmp_path / "policy.jsonl"
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, adaptive_spec=True,
              spec_policy=SWITCHY, trace_policy=str(trace), **ENGINE)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True))
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == sum(llm.stats().rounds_by_nodes.values())
    assert all(line["nodes"] in (16, 8, 4, 0) and line["rows"] in (1, 2) for line in lines)
    assert [option[0] for option in lines[-1]["estimates"]["options"]] == [16, 8, 4, 0]
    assert sum(o.rounds for o in outs) >= len(lines)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_full_lag_catches_up_every_lagging_row_in_one_pass(pair, plain, method, monkeypatch):
    """Rows that joined at different times: when one row's lag is full, every lagging row is
    caught up in the same drafter pass, so the rows fall into step (one pass per lag capacity
    rounds, not one per row); the tokens stay plain decoding's."""
    import flashtree.speculative.drafter as proposer_module

    monkeypatch.setattr(proposer_module, "lag_capacity", lambda *_: 4)
    llm = LLM(str(pair.target), spec=method, draft=str(pair.drafter), budget=BUDGET, **ENGINE)
    llm.engine.policy = ScriptedPolicy(llm.engine.policy.ladder, [0])  # plain rounds only
    passes = []
    real_catch_up = llm.engine.proposer.catch_up_rows
    monkeypatch.setattr(llm.engine.proposer, "catch_up_rows",
                        lambda slots, *rest: (passes.append(sorted(slots.tolist())), real_catch_up(slots, *rest)))
    prompts = [p for p in PROMPTS if len(p) > ENGINE["prefill_chunk"]][:3]  # (not deferred at prefill)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    reqs = []
    for prompt in prompts:  # one request joins every other step
        reqs.append(llm.engine.add_request(prompt, params))
        llm.engine.step(), llm.engine.step()
    llm.engine.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain.generate(prompts, params)]
    slots = sorted(r.slot for r in reqs)
    together = [p for p in passes if p == slots]
    assert len(together) >= 4 and len(passes) <= len(together) + 3, passes  # after joining, always together
