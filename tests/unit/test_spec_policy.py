"""The adaptive speculation policy, driven by fake measurements (no models): it explores every
option, prefers plain rounds when drafts are not accepted, big trees when they are and rounds
cost the same, adapts to the batch size per rows bucket, re-probes neighbours and follows drift."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from flashtree.config import PolicyConfig
from flashtree.errors import ConfigError
from flashtree.policy import AdaptivePolicy, FixedNodes, node_ladder, rows_bucket

LADDER = node_ladder(256, chain=False)  # (256, 128, 64, 32, 16, 8, 4, 0)


def drive(policy: AdaptivePolicy, rounds: int, rows: int, acceptance, seconds, overlapped: bool = False) -> list[int]:
    """Run ``rounds`` decisions, feeding back ``acceptance(nodes)`` and ``seconds(rows, nodes)``;
    ``overlapped``: the held settled rounds are folded after each decision, as an engine whose
    device runs ahead does while the round runs."""
    chosen = []
    for _ in range(rounds):
        nodes = policy.choose(rows)
        if overlapped:
            policy.fold_settled()
        policy.record(rows, nodes, seconds(rows, nodes), acceptance(nodes) if nodes else 1.0)
        chosen.append(nodes)
    return chosen


def probe_runs(chosen: list[int], usual: int, start: int = 0) -> list[tuple[int, int, int]]:
    """(first index, length, option) of each run of rounds that are not ``usual`` (the probes)."""
    runs = []
    for i in range(start, len(chosen)):
        if chosen[i] == usual:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][2] == chosen[i]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, chosen[i])
        else:
            runs.append((i, 1, chosen[i]))
    return runs


def growing_acceptance(nodes: int) -> float:
    """A good drafter: more nodes, more accepted tokens (diminishing)."""
    return 1.0 + 0.5 * math.log2(nodes + 1)


def batch_bound_seconds(rows: int, nodes: int) -> float:
    """A device that is launch-bound below 256 verified tokens and compute-bound above."""
    return 0.01 * max(1.0, rows * (nodes + 1) / 256)


def test_ladders_and_buckets():
    assert LADDER == (256, 128, 64, 32, 16, 8, 4, 0)
    assert node_ladder(15, chain=True) == (15, 0)
    assert node_ladder(0, chain=False) == (0,) and node_ladder(0, chain=True) == (0,)
    assert node_ladder(5, chain=False) == (5, 0)
    assert node_ladder(64, chain=False, min_tree_nodes=16) == (64, 32, 16, 0)
    assert [rows_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError):
        rows_bucket(0)


def test_config_is_validated():
    for bad in (dict(smoothing=0.0), dict(smoothing=1.5), dict(explore_rounds=0), dict(probe_interval=0),
                dict(probe_interval=100, max_probe_interval=50),
                dict(min_tree_nodes=0), dict(explore_rounds=1.5), dict(settled_batch=0),
                dict(probe_cost_share=0.0), dict(probe_cost_share=1.5)):
        with pytest.raises(ConfigError):
            PolicyConfig(**bad)
    with pytest.raises(ValueError):
        AdaptivePolicy((4, 4, 0))


def test_explores_every_option_first():
    policy = AdaptivePolicy(LADDER, PolicyConfig(explore_rounds=2))
    first = drive(policy, 2 * len(LADDER), 1, lambda n: 1.5, lambda rows, nodes: 0.01)  # all close
    assert sorted(first) == sorted(LADDER * 2)
    assert first[:len(LADDER)] == sorted(LADDER)  # round robin, smallest first (it bounds the bigger trees)


def test_clearly_worse_options_are_not_explored_twice():
    """At 4 rows the 256-node tree and plain rounds give under half the best tokens/s after
    one round each: exploration does not repeat them."""
    policy = AdaptivePolicy(LADDER, PolicyConfig(explore_rounds=2))
    first = drive(policy, 2 * len(LADDER), 4, growing_acceptance, batch_bound_seconds)
    assert first[:len(LADDER)] == sorted(LADDER)
    assert first.count(256) == 1 and first.count(0) == 1 and first.count(64) >= 2


def test_untimed_rounds_do_not_count_as_explored():
    """A round whose time is not representative (a CUDA-graph capture) is measured again."""
    policy = AdaptivePolicy((8, 0), PolicyConfig(explore_rounds=1))
    assert policy.choose(1) == 0
    policy.record(1, 0, None, 1.0)
    assert policy.choose(1) == 0
    policy.record(1, 0, 0.01, 1.0)
    assert policy.choose(1) == 8


def test_prefers_plain_when_drafts_are_rejected():
    """Acceptance ~1 and speculative rounds cost more: plain rounds, except the rare probe."""
    config = PolicyConfig(probe_interval=50)
    policy = AdaptivePolicy(LADDER, config)
    chosen = drive(policy, 400, 8, lambda n: 1.0, batch_bound_seconds)
    assert policy.best(8) == 0
    tail = chosen[-200:]
    assert tail.count(0) >= 200 - config.probe_rounds * (200 // 50 + 1) and set(tail) <= {0, 4}  # probes: the neighbour


def test_prefers_the_big_tree_when_acceptance_is_high_and_cost_flat():
    policy = AdaptivePolicy(LADDER)
    chosen = drive(policy, 300, 2, growing_acceptance, lambda rows, nodes: 0.01)
    assert policy.best(2) == 256
    # two neighbour probes and one plain recheck (every plain_recheck_interval rounds) at most
    assert chosen[-100:].count(256) >= 100 - 3 * policy.config.probe_rounds


def test_the_choice_adapts_to_the_batch_and_unseen_buckets_explore():
    """Same drafter, busier device: batch 1 takes the big tree, batch 32 a small one; a bucket
    never seen before explores all options itself before trusting estimates."""
    policy = AdaptivePolicy(LADDER)
    drive(policy, 100, 1, growing_acceptance, batch_bound_seconds)
    assert policy.best(1) == 256
    first = drive(policy, len(LADDER), 32, growing_acceptance, batch_bound_seconds)
    # bucket 32: its own exploration, smaller trees first; the 32-node tree's round time bounds the
    # 64- and 128-node trees (known acceptance / at least that time) under half the best: skipped
    assert first[:5] == [0, 4, 8, 16, 32] and 64 not in first and 128 not in first, first
    drive(policy, 100, 32, growing_acceptance, batch_bound_seconds)
    expected = max(LADDER, key=lambda n: growing_acceptance(n) / batch_bound_seconds(32, n) if n else
                   1.0 / batch_bound_seconds(32, 0))
    assert policy.best(32) == expected and expected <= 16
    assert policy.best(1) == 256  # the other bucket keeps its own choice
    assert policy.best(30) == policy.best(32)  # 30 rows share bucket 32


def test_reprobes_a_close_neighbour_every_interval():
    """The neighbour (128) is within BACKOFF_BELOW of the best (256): no back-off."""
    config = PolicyConfig(probe_interval=10)
    policy = AdaptivePolicy(LADDER, config)
    drive(policy, 100, 1, growing_acceptance, lambda rows, nodes: 0.01)  # converged on 256
    chosen = drive(policy, 60, 1, growing_acceptance, lambda rows, nodes: 0.01)
    runs = probe_runs(chosen, usual=256)
    starts = [first for first, _, _ in runs]
    assert len(runs) >= 4 and all(b - a == config.probe_interval + config.probe_rounds - 1  # interval counts
                                  for a, b in zip(starts, starts[1:]))  # from a probe's last round
    assert all(option == 128 for _, _, option in runs)  # the only neighbour of the top option
    assert all(length == config.probe_rounds for _, length, _ in runs[:-1])  # each probe: probe_rounds rounds


def test_probes_back_off_while_the_neighbour_stays_clearly_worse():
    """A drafter that never matches and rounds that cost 1.6x a plain step: probe intervals
    double up to max_probe_interval, so probes cost next to nothing in a long run (the doubling
    alone: without the probe_cost_share floor, tested below)."""
    config = PolicyConfig(probe_interval=50, max_probe_interval=400, probe_cost_share=None)
    policy = AdaptivePolicy(LADDER, config)
    cost = lambda rows, nodes: 0.01 * (1.6 + nodes / 256) if nodes else 0.01  # noqa: E731
    chosen = drive(policy, 4000, 1, lambda n: 1.0, cost)
    runs = probe_runs(chosen, usual=0, start=100)
    gaps = [b[0] - a[0] - (config.probe_rounds - 1) for a, b in zip(runs, runs[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 400 and gaps[0] <= 200
    assert {option for _, _, option in runs} == {4} and len(runs) <= 15


def test_a_far_worse_neighbour_is_probed_only_every_max_interval():
    """At 32 rows a tree round costs 4 plain rounds and accepts 1.2 tokens (a CPU whose verify is
    compute-bound): after one probe shows it under DOMINATED of plain, the next comes
    max_probe_interval rounds later (doubling from 50 would have spent four more probes first),
    and each probe is a single round (32 rows' acceptance in one; 4 rounds at one row). (Without
    the probe_cost_share floor, which would space them further: tested below.)"""
    config = PolicyConfig(probe_interval=50, max_probe_interval=800, probe_cost_share=None)
    policy = AdaptivePolicy((4, 0), config)
    chosen = drive(policy, 2000, 32, lambda n: 1.2, lambda rows, n: 0.04 if n else 0.01)
    runs = probe_runs(chosen, usual=0, start=10)
    gaps = [b[0] - a[0] - (a[1] - 1) for a, b in zip(runs, runs[1:])]
    assert len(runs) <= 3 and all(gap == config.max_probe_interval for gap in gaps), runs
    assert all(length == 1 for _, length, _ in runs), runs


def probe_cost_share_spent(chosen: list[int], rows: int, seconds, usual: int = 0) -> tuple[float, int]:
    """The share of a run's time its probes lost (each probe round's time over the usual option's,
    tokens being the same for a drafter that never matches) and how many probe rounds it ran."""
    total = sum(seconds(rows, n) for n in chosen)
    lost = sum(seconds(rows, n) - seconds(rows, usual) for n in chosen if n != usual)
    return lost / total, sum(n != usual for n in chosen)


def h200_one_row_seconds(rows: int, nodes: int) -> float:
    """One row on the H200 at Qwen3-8B shape: a plain round 4.7 ms, a tree of 4 2.1 ms more."""
    return 0.0047 + (0.0021 + 0.00001 * nodes if nodes else 0.0)


def test_a_costly_probe_that_changes_nothing_keeps_within_its_cost_share():
    """One row, a drafter that never matches, a tree of 4 costing 1.45 plain rounds: each probe
    (4 rounds) loses 2 plain rounds' time. Doubling alone spends it every max_probe_interval rounds
    (0.25% of the time); with probe_cost_share the probes stay within 0.1%, yet still come."""
    floored = AdaptivePolicy(LADDER, PolicyConfig())
    doubling = AdaptivePolicy(LADDER, PolicyConfig(probe_cost_share=None))
    never_matches = lambda n: 1.0  # noqa: E731
    warm_up = 200  # exploration and the first probe (at probe_interval), which measures the probe's cost
    spent = {}
    for name, policy in (("floored", floored), ("doubling", doubling)):
        chosen = drive(policy, 12000, 1, never_matches, h200_one_row_seconds)[warm_up:]
        spent[name] = probe_cost_share_spent(chosen, 1, h200_one_row_seconds)
    share, probe_rounds = spent["floored"]
    assert share <= floored.config.probe_cost_share and probe_rounds >= 2 * floored.config.probe_rounds
    assert spent["doubling"][0] > 2 * share  # the floor is what keeps it there


def test_a_cheap_probe_ends_on_the_doubling_schedule():
    """32 rows, where a tree round costs 1.3 plain rounds and one round is a whole probe: its floor
    (0.3 plain rounds lost per probe: 300 rounds) replaces the doubling's first steps but stays
    under max_probe_interval, so the probes end up every max_probe_interval rounds, as doubling's."""
    cost = lambda rows, nodes: 0.01 * (1.3 if nodes else 1.0)  # noqa: E731
    gaps = {}
    for share in (0.001, None):
        chosen = drive(AdaptivePolicy((8, 4, 0), PolicyConfig(probe_cost_share=share)), 6000, 32, lambda n: 1.0, cost)
        runs = probe_runs(chosen, usual=0, start=20)
        gaps[share] = [b[0] - a[0] for a, b in zip(runs, runs[1:])]
    assert gaps[0.001][0] in (300, 301) and gaps[None][0] == 100  # the floor (ceil of 300, in floats), against
    # the first doubling
    assert gaps[0.001][-2:] == gaps[None][-2:] == [800, 800]


def test_a_drafter_that_starts_to_match_is_found_after_the_floored_interval():
    """A drafter that never matched starts to (acceptance 3 for a tree of 4): at one row the
    floored interval is about 1,800 rounds, and within it plus a probe the policy moves to trees."""
    policy = AdaptivePolicy((16, 4, 0), PolicyConfig())
    drive(policy, 3000, 1, lambda n: 1.0, h200_one_row_seconds)
    assert policy.best(1) == 0
    chosen = drive(policy, 2500, 1, lambda n: 3.0, h200_one_row_seconds)
    assert policy.best(1) != 0 and chosen[-100:].count(0) < 100 // 2


def test_follows_drift_down_to_plain():
    """The drafter stops matching (e.g. the conversation changed): the policy walks down the
    ladder as each option's acceptance estimate is refreshed, and settles on plain rounds (at
    batch 1 each option's acceptance EMA takes some 50 rounds to fall: one row is one sample)."""
    policy = AdaptivePolicy(LADDER, PolicyConfig(probe_interval=20))
    cost = lambda rows, nodes: 0.01 * (1 + nodes / 4096)  # noqa: E731 - slightly dearer per node
    drive(policy, 200, 1, growing_acceptance, cost)
    assert policy.best(1) == 256
    chosen = drive(policy, 800, 1, lambda n: 1.0, cost)
    assert policy.best(1) == 0 and chosen[-50:].count(0) >= 50 - 3 * policy.config.probe_rounds  # probes every 20+
    drive(policy, 800, 1, growing_acceptance, cost)  # and back up, a ladder step per probe or two
    assert policy.best(1) == 256


def test_deterministic_given_the_same_measurements():
    runs = []
    for _ in range(2):
        policy = AdaptivePolicy(LADDER, PolicyConfig(probe_interval=7))
        runs.append(drive(policy, 150, 3, growing_acceptance, batch_bound_seconds)
                    + drive(policy, 150, 12, lambda n: 1.2, batch_bound_seconds))
    assert runs[0] == runs[1]


def test_plain_acceptance_is_exactly_one():
    policy = AdaptivePolicy(LADDER)
    policy.record(1, 0, 0.01, 5.0)  # ignored: a plain round commits exactly one token
    assert policy.acceptance(0) == 1.0 and policy.acceptance(16) is None
    with pytest.raises(ValueError):
        policy.record(1, 7, 0.01, 1.0)  # not on the ladder


def test_fixed_nodes_is_todays_behaviour():
    fixed = FixedNodes(64)
    assert fixed.ladder == (64,) and [fixed.choose(r) for r in (1, 8, 64)] == [64, 64, 64]
    fixed.record(8, 64, 0.01, 3.0)
    assert fixed.choose(8) == 64


def test_fixed_nodes_under_a_round_token_bound_verify_the_largest_option_that_fits():
    """max_round_tokens 136: 16 nodes fit a bucket of 8 rows (8 x 17); in one of 16 rows 8 nodes would verify 144
    tokens, so 4 (80); a bucket of 32 rows runs plain rounds; a chain's only smaller option is plain."""
    tree = FixedNodes(16, node_ladder(16, chain=False), max_round_tokens=136)
    assert [tree.choose(r) for r in (1, 5, 8, 9, 16, 17, 32, 64)] == [16, 16, 16, 4, 4, 0, 0, 0]
    assert tree.settled_on_plain(64) and not tree.settled_on_plain(8)
    assert tree.widest_round(64) == (8, 16)  # 136 tokens; 4 nodes at 16 rows are 80, plain at 64 rows 64
    assert tree.widest_round(200) == (200, 0)  # plain rounds of 200 rows verify the most
    chain = FixedNodes(15, node_ladder(15, chain=True), max_round_tokens=136)
    assert [chain.choose(r) for r in (8, 9)] == [15, 0]
    with pytest.raises(ValueError, match="ladder"):
        FixedNodes(16, (8, 4, 0), max_round_tokens=136)


def test_the_schedulers_round_token_bound_reaches_either_policy():
    from flashtree.config import SchedulerConfig, SpeculationConfig
    from flashtree.policy import make_policy

    fixed = SpeculationConfig(method="ddtree", draft="drafter", adaptive=False)
    assert make_policy(fixed, 64, chain=False).ladder == (64,)  # no bound: today's fixed policy
    bounded = make_policy(fixed, 64, chain=False, max_round_tokens=520)
    assert bounded.ladder == node_ladder(64, chain=False) and bounded.choose(8) == 64 and bounded.choose(16) == 16
    adaptive = SpeculationConfig(method="ddtree", draft="drafter")
    assert make_policy(adaptive, 64, chain=False, device_type="cpu", max_round_tokens=96).config.max_round_tokens == 96
    assert make_policy(adaptive, 64, chain=False, device_type="cpu", max_round_tokens=999).config.max_round_tokens == 128
    assert make_policy(adaptive, 64, chain=False, device_type="cuda", graph_tokens=4096,
                       max_round_tokens=2048).config.max_round_tokens == 2048
    with pytest.raises(ConfigError, match="max_round_tokens .* must be at least max_running"):
        SchedulerConfig(max_running=64, max_round_tokens=32)


TREES_ACCEPT_A_LITTLE = lambda n: 1.15 if n else 1.0  # noqa: E731 (a weak drafter: trees below plain)


def test_a_stalled_round_barely_moves_the_estimate():
    """One round 50x slower (another process took the CPU) does not flip the choice. Plain rounds
    that become slower for good while trees do not (a change of their own cost, not the machine's
    pace) move it at the next probe, which re-times the tree (trees accept 1.1 tokens: below
    plain while plain rounds cost 10 ms)."""
    config = PolicyConfig(probe_interval=20, max_probe_interval=20)
    policy = AdaptivePolicy((8, 0), config)
    cost = {8: 0.015, 0: 0.010}
    accept = lambda n: 1.1 if n else 1.0  # noqa: E731
    drive(policy, 20, 1, accept, lambda rows, n: cost[n])
    assert policy.best(1) == 0
    policy.record(1, 0, 0.5, None)
    assert policy.best(1) == 0
    cost[0] = 0.05  # plain rounds became slow for good
    chosen = drive(policy, config.probe_interval + 2 * config.probe_rounds, 1, accept, lambda rows, n: cost[n])
    assert policy.best(1) == 8 and chosen[-2 * config.probe_rounds:].count(8) >= config.probe_rounds, chosen


def test_a_drafter_that_never_matches_never_moves_the_choice_to_a_tree():
    """Trees never accepted: a stretch of plain rounds at twice their cost (the device busy, a
    burst of HTTP work) lifts plain's estimate above the trees' old ones, but a tree round never
    costs less than a plain one, so no tree is chosen (probes aside: the H200 server ran 150-190
    tree rounds per 1,524-round pass before the policy used the monotone times)."""
    config = PolicyConfig()
    policy = AdaptivePolicy((64, 32, 16, 8, 4, 0), config)
    quiet = {0: 0.0056, 4: 0.0095, 8: 0.0078, 16: 0.0083, 32: 0.0085, 64: 0.0092}
    drive(policy, 2000, 1, lambda n: 1.0, lambda rows, n: quiet[n])
    stretch = drive(policy, 200, 1, lambda n: 1.0, lambda rows, n: quiet[n] * (2.0 if n == 0 else 1.0))
    assert policy.best(1) == 0
    assert sum(1 for n in stretch if n) <= 2 * config.probe_rounds, Counter(stretch)


def test_slow_rounds_of_the_chosen_option_move_every_estimate_alike():
    """Plain rounds cost 5 ms and trees of 8 nodes 7 ms; trees accept 1.15 tokens. A burst of
    slow plain rounds (another thread busy) lifts the other options' estimates with plain's (the
    machine's pace, see "Common pace"), so the choice stays on plain: during the burst and after
    it only the regular probes run a tree (the H200 server ran about 50 tree rounds per such
    event when a burst could move the choice and the recheck waited ``probe_interval`` rounds)."""
    config = PolicyConfig()
    policy = AdaptivePolicy((8, 4, 0), config)
    quiet = {0: 0.005, 4: 0.0075, 8: 0.007}
    drive(policy, 2000, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: quiet[n])  # settled; probes backed off
    assert policy.best(1) == 0
    ratio = policy.tokens_per_second(1, 8) / policy.tokens_per_second(1, 0)
    burst = drive(policy, 40, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: 0.0099 if n == 0 else quiet[n])
    assert policy.best(1) == 0 and policy.tokens_per_second(1, 8) / policy.tokens_per_second(1, 0) == \
        pytest.approx(ratio)  # the relative costs are what the probes measured, not the burst
    after = drive(policy, config.probe_interval + 20, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: quiet[n])
    assert policy.best(1) == 0
    assert sum(1 for n in burst + after if n) <= 2 * config.probe_rounds, (burst, after)


@pytest.mark.parametrize("settled_batch, overlapped", [(1, False), (8, False), (8, True)])
def test_a_slow_stretch_of_a_cpu_server_keeps_a_big_batch_on_plain_rounds(settled_batch, overlapped):
    """A CPU server at 32 rows (SmolLM2 + the shipped drafter, measured on a 2-core EPYC: plain
    rounds 123 ms, tree-4 rounds 540 ms, acceptance 2.2), settled on plain rounds, meets 20 rounds
    at 3x the cost of every option (other processes on the machine). Before the common pace, the
    stretch's plain rounds lifted plain's estimate above the tree's quiet one: trees ran during
    the stretch and for 52 rounds after it (a served pass at 0.71-0.80 of plain's throughput).
    Now only the regular probes run a tree, folded in batches or one by one."""
    config = PolicyConfig(settled_batch=settled_batch)
    cost = lambda slow: (lambda rows, n: slow * (0.540 if n else 0.123))  # noqa: E731
    accept = lambda n: 2.2  # noqa: E731

    def run(slow: float) -> list[int]:
        policy = AdaptivePolicy((4, 0), config)
        chosen = drive(policy, 200, 32, accept, cost(1.0), overlapped)
        chosen += drive(policy, 20, 32, accept, cost(slow), overlapped)
        chosen += drive(policy, 300, 32, accept, cost(1.0), overlapped)
        assert policy.best(32) == 0
        return chosen

    quiet, stretched = run(1.0), run(3.0)
    assert stretched == quiet  # the same rounds: the regular probes only
    assert sum(1 for n in quiet[10:] if n) <= 3, quiet  # (one per interval; the interval backs off)


def test_plain_is_rechecked_while_a_tree_is_chosen():
    """Plain rounds cost 11.2 ms, trees 7.5-9.5 ms (trees of 8 nodes and more accept 1.1 tokens, of
    4 nodes none): the best tree (8 nodes, mid-ladder: its neighbours are trees) is chosen. Then
    plain rounds become cheap (5.6 ms; their own cost, not the machine's pace). The neighbour
    probes alone never re-measure plain (a tree stayed chosen for 3,000 rounds of 3,000 in the
    seventh session's version of this test); the plain recheck brings it back within
    ``plain_recheck_interval`` rounds."""
    config = PolicyConfig()
    policy = AdaptivePolicy((64, 32, 16, 8, 4, 0), config)
    quiet = {0: 0.0112, 4: 0.0075, 8: 0.0085, 16: 0.0088, 32: 0.0090, 64: 0.0095}
    accept = lambda n: 1.0 if n in (0, 4) else 1.1  # noqa: E731
    drive(policy, 2000, 1, accept, lambda rows, n: quiet[n])
    assert policy.best(1) == 8
    quiet[0] = 0.0056
    after = drive(policy, 3000, 1, accept, lambda rows, n: quiet[n])
    back = next(i for i in range(len(after)) if after[i:i + 50] == [0] * 50)  # plain for good
    assert back <= config.plain_recheck_interval and policy.best(1) == 0, back
    assert after[back:].count(0) >= len(after[back:]) - 10 * config.probe_rounds  # only probes after that


def test_big_trees_whose_bound_is_clearly_worse_are_never_explored_at_a_big_batch():
    """A drafter that never matches, learnt at batch 1 (acceptance 1 for every tree); at 32 rows a
    round costs 1 + nodes / 8 plain rounds. Exploring bucket 32 smallest first, the timed 16-node
    tree bounds the bigger ones (acceptance 1 / at least its time) under half of plain's tokens/s,
    so the 32- and 64-node trees (5 and 9 plain rounds each) never run there."""
    policy = AdaptivePolicy((64, 32, 16, 8, 4, 0))
    drive(policy, 300, 1, lambda n: 1.0, lambda rows, n: 0.005 * (1 + n / 256))
    chosen = drive(policy, 300, 32, lambda n: 1.0, lambda rows, n: 0.01 * (1 + n / 8))
    assert policy.best(32) == 0 and 32 not in chosen and 64 not in chosen, Counter(chosen)


def test_probes_average_rounds_so_a_few_unlucky_rounds_do_not_evict_a_better_option():
    """A real drafter's rounds accept 1 to 5 tokens (mean 2.5) and cost 2x a plain step: trees
    are 1.25x faster. Probes of several rounds, averaged, keep the choice on trees; with
    one-round probes the same measurements let a few unlucky probes settle on plain for good."""
    import random

    def tree_rounds(seed: int, **knobs) -> int:
        rng = random.Random(seed)
        policy = AdaptivePolicy((4, 0), PolicyConfig(probe_interval=50, **knobs))
        chosen = drive(policy, 4000, 1, lambda n: float(rng.choice([1, 1, 2, 3, 4, 4])),
                       lambda rows, n: 0.02 if n else 0.01)
        return chosen[-2000:].count(4)

    kept = [tree_rounds(seed) for seed in range(5)]
    assert min(kept) >= 1500  # of 2000; probes of plain aside
    # the former policy (one-round probes, acceptance EMA as fast as the timing's, every round folded
    # in at once) mostly settled on
    # plain: 76 to 572 tree rounds of 2,000 with immediate rechecks, 109 to 334 before them
    former = [tree_rounds(seed, probe_rounds=1, acceptance_smoothing=0.2, settled_batch=1) for seed in range(5)]
    assert all(new >= 3 * old for new, old in zip(kept, former)), (kept, former)


def test_probing_marks_neighbour_probes_only():
    """``probing`` (the engine may decline such rounds when their CUDA graph is missing) is true
    exactly for the rounds of neighbour probes: not for exploration, the best option, rechecks of
    a displaced option or plain rechecks."""
    config = PolicyConfig(probe_interval=10)
    policy = AdaptivePolicy(LADDER, config)
    flags = []
    for _ in range(160):
        nodes = policy.choose(1)
        flags.append((nodes, policy.probing))
        policy.record(1, nodes, 0.01, growing_acceptance(nodes) if nodes else 1.0)
    explored = len(LADDER) * config.explore_rounds
    assert not any(probing for _, probing in flags[:explored])  # exploration
    marked = [i for i, (_, probing) in enumerate(flags) if probing]
    runs = probe_runs([nodes for nodes, _ in flags], usual=256, start=explored)
    assert marked == [first + k for first, length, _ in runs for k in range(length)]  # the probes' rounds
    assert len(runs) >= 4
    # a recheck of a displaced option is timed, so it is not marked
    policy = AdaptivePolicy((8, 4, 0), PolicyConfig())
    drive(policy, 2000, 1, growing_acceptance, lambda rows, n: 0.01)  # settled on 8 nodes
    rechecks = []
    for _ in range(200):  # the drafter stops matching: the choice moves and the displaced tree is rechecked
        nodes = policy.choose(1)
        rechecks.append((nodes, policy.probing, policy._probe.recheck if policy._probe else None))
        policy.record(1, nodes, 0.01, 1.0)
    assert any(kind not in (None, 0) for _, _, kind in rechecks)  # some recheck ran
    assert all(not probing for _, probing, kind in rechecks if kind not in (None, 0))


def test_a_drafter_that_never_matches_explores_no_tree_in_a_new_bucket():
    """Acceptance 1, learnt at batch 1: at 16 rows no tree can beat plain rounds (a round that
    verifies more nodes never costs less), so the new bucket times plain rounds and explores no
    tree; only the neighbour probe, ``probe_interval`` rounds later, tries the smallest one.
    (Exploring every tree there cost a served H200 5-15% of a pass in CUDA-graph captures.)"""
    config = PolicyConfig()
    policy = AdaptivePolicy((64, 32, 16, 8, 4, 0), config)
    drive(policy, 300, 1, lambda n: 1.0, lambda rows, n: 0.005 * (1 + n / 256))
    chosen = drive(policy, config.probe_interval + 10, 16, lambda n: 1.0, lambda rows, n: 0.006 * (1 + n / 64))
    assert chosen[:config.probe_interval] == [0] * config.probe_interval, chosen
    assert set(chosen) <= {0, 4}, Counter(chosen)
    assert policy.best(16) == 0


def drive_declining(policy: AdaptivePolicy, rounds: int, rows: int, acceptance, seconds) -> tuple[list[int], list[int]]:
    """``drive`` as the engine runs it when no probe has a CUDA graph: a neighbour probe whose
    option is not ``worth_a_graph`` is declined and the round runs the best option. Returns the
    options run and the round indices of the declined probes."""
    chosen, declined = [], []
    for i in range(rounds):
        nodes = policy.choose(rows)
        if nodes and policy.probing and not policy.worth_a_graph(rows, nodes):
            policy.decline_probe()
            declined.append(i)
            nodes = policy.best(rows)
        policy.record(rows, nodes, seconds(rows, nodes), acceptance(nodes) if nodes else 1.0)
        chosen.append(nodes)
    return chosen, declined


def test_a_drafter_that_never_matches_makes_no_probe_worth_a_graph_and_declines_back_off():
    """Acceptance 1: no tree's bound beats plain rounds, so every probe at a shape without a graph
    is declined, and the declines space the probes out like probes of a clearly worse option
    (50, 100, 200, 400, 800, 800 rounds). (Untimed probes that never backed off cost served H200
    runs 15-28% of a pass at 4-32 rows.)"""
    config = PolicyConfig()
    policy = AdaptivePolicy((64, 32, 16, 8, 4, 0), config)
    drive(policy, 300, 1, lambda n: 1.0, lambda rows, n: 0.005 * (1 + n / 256))
    assert policy.worth_a_graph(16, 4)  # a bucket with nothing timed yet: no score to beat
    chosen, declined = drive_declining(policy, 3000, 16, lambda n: 1.0, lambda rows, n: 0.006 * (1 + n / 64))
    assert set(chosen) == {0}  # no tree round at all
    assert not any(policy.worth_a_graph(16, n) for n in (64, 32, 16, 8, 4))
    gaps = [b - a for a, b in zip(declined, declined[1:])]
    assert declined[0] < config.probe_interval + 5 and gaps[:5] == [100, 200, 400, 800, 800], (declined, gaps)


def test_a_matching_drafter_finds_its_probes_worth_a_graph():
    """A drafter whose bigger trees accept more: the bigger neighbour of the best option could win
    (its acceptance over the best's round time beats the best's score), so its probe runs."""
    policy = AdaptivePolicy(LADDER, PolicyConfig())
    drive(policy, 500, 1, growing_acceptance, lambda rows, n: 0.01 * (1 + n / 1024))
    best = policy.best(1)
    assert best != 0 and best != LADDER[0]
    bigger = LADDER[LADDER.index(best) - 1]
    assert policy.worth_a_graph(1, bigger)
    chosen, declined = drive_declining(policy, 500, 1, growing_acceptance, lambda rows, n: 0.01 * (1 + n / 1024))
    assert bigger in chosen  # its probes ran


def test_decline_probe_needs_a_neighbour_probe():
    policy = AdaptivePolicy(LADDER, PolicyConfig())
    with pytest.raises(RuntimeError, match="neighbour probe"):
        policy.decline_probe()


# ---------------------------------------------------------------------------- settled rounds

def settled_pair() -> tuple[AdaptivePolicy, AdaptivePolicy]:
    """Two policies in the same state, settled on plain rounds (no probe due for a long while):
    one folds every round in at once, the other holds settled rounds 8 at a time."""
    import copy
    import dataclasses

    config = PolicyConfig(settled_batch=1, probe_interval=800)
    immediate = AdaptivePolicy((8, 4, 0), config)
    drive(immediate, 300, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: 0.005 if n == 0 else 0.007)
    assert immediate.best(1) == 0
    batched = copy.deepcopy(immediate)
    batched.config = dataclasses.replace(config, settled_batch=8)
    return immediate, batched


def test_settled_rounds_are_folded_in_batches_into_the_same_estimates():
    immediate, batched = settled_pair()
    before = batched.snapshot(1)
    seconds = lambda rows, n: 0.006  # noqa: E731 - plain rounds got slower (not enough to move the choice)
    for i in range(7):
        assert drive(immediate, 1, 1, TREES_ACCEPT_A_LITTLE, seconds) == drive(batched, 1, 1, TREES_ACCEPT_A_LITTLE, seconds)
        assert batched.snapshot(1) == before  # held
        assert immediate.snapshot(1) != before
    drive(immediate, 1, 1, TREES_ACCEPT_A_LITTLE, seconds)
    drive(batched, 1, 1, TREES_ACCEPT_A_LITTLE, seconds)  # the 8th: folded, in order
    assert batched.snapshot(1) == immediate.snapshot(1) != before
    assert batched.estimates.seconds(1, 0) == immediate.estimates.seconds(1, 0)


def test_rounds_folded_while_the_next_round_runs_reach_the_same_estimates_a_round_later():
    """The engine's cadence on a device that runs ahead: choose, fold the held rounds while the
    round runs, record. Each round is held for one round, then goes in exactly as if folded at once."""
    immediate, overlapped = settled_pair()
    seconds = lambda rows, n: 0.006  # noqa: E731 - plain rounds got slower (not enough to move the choice)
    for i in range(20):
        nodes = overlapped.choose(1)
        overlapped.fold_settled()
        assert overlapped.snapshot(1) == immediate.snapshot(1)  # every round before this one is in
        overlapped.record(1, nodes, seconds(1, nodes), 1.0)
        assert len(overlapped._settled) == 1  # this one is held
        assert drive(immediate, 1, 1, TREES_ACCEPT_A_LITTLE, seconds) == [nodes]
    assert overlapped.estimates.seconds(1, 0) != immediate.estimates.seconds(1, 0)  # (the last one is held)
    overlapped.fold_settled()
    assert overlapped.estimates.seconds(1, 0) == immediate.estimates.seconds(1, 0)


def test_held_rounds_are_folded_before_anything_else_happens():
    """A probe due, another bucket or a round of another option fold the held rounds first, so
    the measurements go into the estimates in the order they were made."""
    _, policy = settled_pair()
    drive(policy, 3, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: 0.005)
    assert len(policy._settled) == 3
    nodes = policy.choose(2)  # another bucket
    assert policy._settled == []
    policy.record(2, nodes, 0.005, TREES_ACCEPT_A_LITTLE(nodes))
    drive(policy, 3, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: 0.005)
    assert len(policy._settled) == 3
    timed = policy.estimates.timed(1, 4)
    policy.record(1, 4, 0.007, 1.15)  # a round of another option (e.g. a request's own budget)
    assert policy._settled == [] and policy.estimates.timed(1, 4) == timed + 1
    drive(policy, 3, 1, TREES_ACCEPT_A_LITTLE, lambda rows, n: 0.005)
    assert len(policy._settled) == 3
    policy._next_probe[1] = policy._rounds[1] + 1  # a neighbour probe is due at the next round
    assert policy.choose(1) == 4 and policy._settled == []


def test_rounds_over_the_token_cap_are_never_tried_in_that_bucket():
    """max_round_tokens 160: at 32 rows only DDTree-4 fits (32 x 5), at 4 rows up to 32 nodes (4 x 33
    = 132), at 1 row up to 128 (129); trees that always accept and cost little would be chosen otherwise."""
    policy = AdaptivePolicy(LADDER, PolicyConfig(max_round_tokens=160, probe_interval=5))
    accept_all = lambda nodes: min(nodes + 1, 9)  # noqa: E731
    cheap = lambda rows, nodes: 0.01  # noqa: E731
    assert set(drive(policy, 400, 32, accept_all, cheap)) == {0, 4}  # (plain is always an option)
    assert max(drive(policy, 400, 4, accept_all, cheap)) == 32
    assert max(drive(policy, 400, 1, accept_all, cheap)) == 128
    uncapped = AdaptivePolicy(LADDER, PolicyConfig(probe_interval=5))
    assert max(drive(uncapped, 400, 32, accept_all, cheap)) > 4


def test_the_round_token_cap_defaults_by_device():
    from flashtree.config import SpeculationConfig
    from flashtree.policy import make_policy

    spec = SpeculationConfig(method="ddtree", draft="drafter")
    assert make_policy(spec, 64, chain=False, device_type="cpu").config.max_round_tokens == 128
    assert make_policy(spec, 64, chain=False, device_type="cuda").config.max_round_tokens is None
    given = SpeculationConfig(method="ddtree", draft="drafter", policy=PolicyConfig(max_round_tokens=512))
    assert make_policy(given, 64, chain=False, device_type="cpu").config.max_round_tokens == 512
    with pytest.raises(ConfigError, match="max_round_tokens"):
        PolicyConfig(max_round_tokens=0)
