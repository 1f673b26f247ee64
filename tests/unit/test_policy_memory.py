"""The adaptive policy's memory across processes (no models): what a policy learned round-trips
through JSON; a policy started from it skips the exploration an earlier process paid, scales the
relative round times by its own plain rounds, and keeps probing on the earlier schedule, so a drafter
that starts to pay is still found; the file is per setup, written atomically, and one that is
unreadable, of another version or too old is ignored (with a warning when broken)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from flashtree.config import EngineConfig, PolicyConfig, SpeculationConfig
from flashtree.policy import AdaptivePolicy, FixedNodes, make_policy
from flashtree.policy.learned import Learned, LearnedBucket
from flashtree.policy.memory import (
    FORMAT_VERSION,
    MAX_AGE_S,
    PolicyMemory,
    files_identity,
    memory_directory,
)
from tests.unit.test_spec_policy import drive

LADDER = (4, 0)  # a CPU's DDTree ladder (budget 4)
CPU = PolicyConfig(max_round_tokens=128)


def cpu_seconds(pace: float = 1.0):
    """A 2-core CPU with the small shipped pair: a plain step 8 ms, a tree of 4 2.4x that."""
    return lambda rows, nodes: pace * (0.0192 if nodes else 0.008)


def weak_drafter(nodes: int) -> float:
    return 1.5  # below the 2.4 a tree of 4 needs to pay on that CPU


def strong_drafter(nodes: int) -> float:
    return 4.0


def tree_rounds(chosen: list[int]) -> int:
    return sum(1 for n in chosen if n)


def through_json(learned: Learned) -> Learned:
    return Learned.from_json(json.loads(json.dumps(learned.to_json())))


def continued(learned: Learned, config: PolicyConfig = CPU) -> AdaptivePolicy:
    policy = AdaptivePolicy(LADDER, config)
    policy.start_from(through_json(learned))
    return policy


def test_learned_estimates_round_trip_through_json():
    policy = AdaptivePolicy(LADDER, CPU)
    drive(policy, 300, 1, weak_drafter, cpu_seconds())
    drive(policy, 40, 4, weak_drafter, cpu_seconds())
    learned = policy.learned()
    assert set(learned.buckets) == {1, 4} and set(learned.acceptance) == {4}
    assert learned.acceptance[4][0] == pytest.approx(1.5)
    assert learned.buckets[1].relative_seconds[4][0] == pytest.approx(2.4)
    assert through_json(learned) == learned


@pytest.mark.parametrize("bad", [
    [], {"acceptance": {}}, {"acceptance": {"4": [0.5, 3]}, "buckets": {}},  # acceptance below 1
    {"acceptance": {"0": [1.0, 3]}, "buckets": {}},  # plain's is not learned
    {"acceptance": {}, "buckets": {"1": {"relative_seconds": {"4": [2.0]}}}},
    {"acceptance": {}, "buckets": {"0": {"relative_seconds": {}}}},
    {"acceptance": {}, "buckets": {"1": {"relative_seconds": {"4": [float("nan"), 2]}}}},
    {"acceptance": {}, "buckets": {"1": {"relative_seconds": {}, "probe_interval": 0, "rounds_to_probe": 3}}},
    {"acceptance": {"x": [2.0, 3]}, "buckets": {}},
])
def test_malformed_learned_estimates_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        Learned.from_json(bad)


def test_a_weak_drafters_memory_spares_a_fresh_process_its_exploration_and_first_probe():
    """128 new tokens (about 115 rounds) per process: the first process explores the tree (2 rounds)
    and probes it (4 rounds at round ~50); the next ones, started from what it learned, run plain
    rounds only (their next probe is thousands of rounds away), as one long process would."""
    first = AdaptivePolicy(LADDER, CPU)
    chosen = drive(first, 115, 1, weak_drafter, cpu_seconds())
    assert tree_rounds(chosen) == 6
    learned = first.learned()
    assert learned.buckets[1].rounds_to_probe > 10 * 115
    for _ in range(5):
        policy = continued(learned)
        assert tree_rounds(drive(policy, 115, 1, weak_drafter, cpu_seconds())) == 0
        learned = policy.learned()


def test_a_strong_drafters_memory_starts_on_trees_at_once():
    """Only plain rounds are timed first (the relative times wait for them); then trees, no tree exploration."""
    first = AdaptivePolicy(LADDER, CPU)
    drive(first, 115, 1, strong_drafter, cpu_seconds())
    policy = continued(first.learned())
    chosen = drive(policy, 115, 1, strong_drafter, cpu_seconds())
    assert chosen[:2] == [0, 0] and all(chosen[2:40])


def test_relative_round_times_take_the_new_processes_pace():
    """Learned on a machine half as fast; the new process's plain rounds set the scale."""
    first = AdaptivePolicy(LADDER, CPU)
    drive(first, 115, 1, weak_drafter, cpu_seconds(pace=2.0))
    policy = continued(first.learned())
    drive(policy, 3, 1, weak_drafter, cpu_seconds())
    assert policy.estimates.seconds(1, 4) == pytest.approx(0.0192, rel=0.05)
    assert policy.estimates.timed(1, 4) >= CPU.explore_rounds  # (counts as explored)


def test_short_processes_probe_every_max_probe_interval_and_find_prompts_that_start_to_pay():
    """A chain of 128-token processes, each started from the last one's memory: one long process
    would wait thousands of rounds between probes of a weak drafter's tree (the cost floor), the
    chain probes every max_probe_interval rounds (a new process may bring other prompts); when the
    prompts start to pay (acceptance 4 from process 20 on), a probe within that many rounds finds
    it and later processes start on trees."""
    learned, trees_by_process = None, []
    for process in range(40):
        policy = AdaptivePolicy(LADDER, CPU) if learned is None else continued(learned)
        drafter = weak_drafter if process < 20 else strong_drafter
        trees_by_process.append(tree_rounds(drive(policy, 115, 1, drafter, cpu_seconds())))
        learned = policy.learned()
    probes = sum(trees_by_process[1:20]) / CPU.probe_rounds
    most = 19 * 115 // CPU.max_probe_interval
    assert probes == int(probes) and most <= probes <= most + 1
    found = next(p for p in range(20, 40) if trees_by_process[p] > CPU.probe_rounds)
    assert (found - 20) * 115 <= CPU.max_probe_interval + 115, trees_by_process
    assert all(trees >= 100 for trees in trees_by_process[found + 1:]), trees_by_process


def test_buckets_a_process_did_not_run_keep_what_it_started_from():
    first = AdaptivePolicy(LADDER, CPU)
    drive(first, 200, 4, weak_drafter, cpu_seconds())
    policy = continued(first.learned())
    drive(policy, 50, 1, weak_drafter, cpu_seconds())
    assert policy.learned().buckets[4] == first.learned().buckets[4]


def test_start_from_comes_before_the_first_round_and_ignores_options_off_the_ladder():
    policy = AdaptivePolicy(LADDER, CPU)
    learned = Learned({4: (2.0, 5), 16: (3.0, 5)}, {1: LearnedBucket({4: (2.0, 3), 16: (3.0, 3)}, 100, 10)})
    policy.start_from(learned)
    assert policy.acceptance(16) is None and policy.acceptance(4) == pytest.approx(2.0)
    drive(policy, 3, 1, weak_drafter, cpu_seconds())
    assert policy.estimates.seconds(1, 16) is None
    with pytest.raises(RuntimeError, match="before the policy's first round"):
        policy.start_from(learned)


# ---------------------------------------------------------------------------- the file

def engine_config(tmp_path, **spec) -> EngineConfig:
    drafter = tmp_path / "drafter"
    drafter.mkdir(exist_ok=True)
    (drafter / "model.safetensors").write_bytes(b"weights")
    return EngineConfig(speculation=SpeculationConfig(method="ddtree", draft=str(drafter), **spec))


def memory_for(tmp_path, monkeypatch, **spec) -> PolicyMemory:
    monkeypatch.setenv("FLASHTREE_POLICY_CACHE", str(tmp_path / "memory"))
    memory = PolicyMemory.for_engine(engine_config(tmp_path, **spec), torch.device("cpu"), torch.float32)
    assert memory is not None
    return memory


def learned_policy() -> AdaptivePolicy:
    policy = AdaptivePolicy(LADDER, CPU)
    drive(policy, 115, 1, weak_drafter, cpu_seconds())
    return policy


def test_the_memory_keeps_and_recalls_per_setup(tmp_path, monkeypatch):
    memory = memory_for(tmp_path, monkeypatch)
    policy = learned_policy()
    key = memory.key(policy)
    path = memory.keep(key, policy.learned())
    assert path.parent == tmp_path / "memory" and os.listdir(path.parent) == [path.name]  # no temporary left
    assert memory.recall(key) == policy.learned()
    saved = json.loads(path.read_text())
    assert saved["version"] == FORMAT_VERSION and saved["key"]["threads"] == torch.get_num_threads()
    other_ladder = AdaptivePolicy((8, 4, 0), CPU)
    assert memory.path(memory.key(other_ladder)) != path and memory.recall(memory.key(other_ladder)) is None


def test_a_changed_drafter_file_is_another_setup(tmp_path, monkeypatch):
    memory = memory_for(tmp_path, monkeypatch)
    policy = learned_policy()
    memory.keep(memory.key(policy), policy.learned())
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"retrained weights")
    retrained = memory_for(tmp_path, monkeypatch)
    assert retrained.recall(retrained.key(policy)) is None


@pytest.mark.parametrize("damage", ["not json", "version", "learned", "old", "key"])
def test_an_unusable_file_is_ignored(tmp_path, monkeypatch, caplog, damage):
    memory = memory_for(tmp_path, monkeypatch)
    policy = learned_policy()
    key = memory.key(policy)
    path = memory.keep(key, policy.learned())
    saved = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{truncated")
    else:
        if damage == "version":
            saved["version"] = FORMAT_VERSION + 1
        elif damage == "learned":
            saved["learned"]["acceptance"] = {"4": ["high", 3]}
        elif damage == "old":
            saved["saved_at"] = time.time() - MAX_AGE_S - 60
        else:
            saved["key"]["threads"] = -1
        path.write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="flashtree"):
        assert memory.recall(key) is None
    warned = any(str(path) in record.getMessage() for record in caplog.records)
    assert warned == (damage in ("not json", "version", "learned"))  # old or another key's: quietly


def test_attach_starts_the_policy_from_the_memory(tmp_path, monkeypatch):
    memory = memory_for(tmp_path, monkeypatch)
    spec = SpeculationConfig(method="ddtree", draft="d", policy=CPU)
    first = make_policy(spec, 4, chain=False, device_type="cpu")
    drive(first, 115, 1, weak_drafter, cpu_seconds())
    memory.keep(memory.key(first), first.learned())
    started = make_policy(spec, 4, chain=False, device_type="cpu", memory=memory)
    assert started.acceptance(4) == pytest.approx(1.5)
    assert tree_rounds(drive(started, 115, 1, weak_drafter, cpu_seconds())) == 0


def test_the_memory_is_off_when_asked_or_when_nothing_adapts(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTREE_POLICY_CACHE", "off")
    assert memory_directory() is None
    assert PolicyMemory.for_engine(engine_config(tmp_path), torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv("FLASHTREE_POLICY_CACHE", str(tmp_path))
    for spec in ({"policy_cache": False}, {"adaptive": False}):
        assert PolicyMemory.for_engine(engine_config(tmp_path, **spec), torch.device("cpu"), torch.float32) is None
    plain = EngineConfig(speculation=SpeculationConfig(method="none"))
    assert PolicyMemory.for_engine(plain, torch.device("cpu"), torch.float32) is None
    assert isinstance(make_policy(SpeculationConfig(method="ddtree", draft="d", adaptive=False), 4, False, "cpu"),
                      FixedNodes)
    monkeypatch.delenv("FLASHTREE_POLICY_CACHE")
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path / "root"))
    assert memory_directory() == tmp_path / "root" / "policy"


def test_files_identity_names_what_it_cannot_stat(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"1234")
    assert files_identity("org/model") == {"name": "org/model"}
    assert files_identity(str(tmp_path / "model.gguf"))["files"][0][:2] == ["model.gguf", 4]
    assert files_identity(None) is None


def test_writing_deletes_files_past_the_age_limit(tmp_path, monkeypatch):
    memory = memory_for(tmp_path, monkeypatch)
    stale, recent = tmp_path / "memory" / "stale.json", tmp_path / "memory" / "recent.json"
    stale.parent.mkdir()
    for path in (stale, recent):
        path.write_text("{}")
    old = time.time() - MAX_AGE_S - 60
    os.utime(stale, (old, old))
    kept = memory.save(learned_policy())
    assert not stale.exists() and recent.exists() and kept.exists()


def test_at_exit_the_last_policy_of_a_setup_that_ran_rounds_is_written(tmp_path, monkeypatch):
    import flashtree.policy.memory as memory_module

    monkeypatch.setattr(memory_module, "_AT_EXIT", {})
    memory = memory_for(tmp_path, monkeypatch)
    earlier, later = AdaptivePolicy(LADDER, CPU), AdaptivePolicy(LADDER, CPU)
    memory.attach(earlier)
    memory.attach(later)
    drive(earlier, 115, 1, weak_drafter, cpu_seconds())
    memory_module._save_at_exit()
    assert not list(tmp_path.glob("memory/*.json"))  # the later policy, which replaced the earlier, ran no round
    drive(later, 115, 1, strong_drafter, cpu_seconds())
    memory_module._save_at_exit()
    assert memory.recall(memory.key(later)).acceptance[4][0] == pytest.approx(4.0)


def test_a_skewed_relative_time_is_corrected_within_the_process():
    """A memory whose tree looks 3x cheaper than it is (learned while a load spike slowed the plain
    rounds it was measured against) starts a process on trees; its early plain recheck re-times plain
    rounds, the process moves to them, and what it keeps has the tree's true relative cost. (The
    tree's own rounds cannot show it: while it is best, plain's estimate follows its pace.)"""
    skewed = Learned({4: (1.5, 20)}, {1: LearnedBucket({4: (0.8, 5)}, 3000, 2900)})
    policy = continued(skewed)
    chosen = drive(policy, 115, 1, weak_drafter, cpu_seconds())
    assert chosen[2:CPU.probe_interval - 2] == [4] * (CPU.probe_interval - 4)
    after_recheck = chosen[CPU.probe_interval + CPU.probe_rounds:2 * CPU.probe_interval]
    assert after_recheck == [0] * len(after_recheck), chosen
    assert policy.learned().buckets[1].relative_seconds[4][0] == pytest.approx(2.4, rel=0.15)
