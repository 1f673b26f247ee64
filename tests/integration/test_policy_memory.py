"""The adaptive policy's memory in engines and processes: a ``flashtree generate`` process writes
what its policy learned at exit, the next one of the same setup starts from it (same tokens as plain
decoding either way), ``--no-policy-cache`` writes nothing; in an engine, a drafter that always
matches keeps drafted rounds from the first round after plain's timing, one that never matches
keeps plain rounds without exploring trees again.

Engine tests run on a read-count clock (tests/support/clocks.py) with the oracle drafter of
test_adaptive_spec: the same measurements on every machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

import flashtree.engine.engine as engine_module
from flashtree import LLM, SamplingParams
from flashtree.policy.memory import PolicyMemory
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.integration.test_adaptive_spec import (
    BUDGET,
    ENGINE,
    ORACLE_DEPTH,
    OracleProposer,
    RecordingPolicy,
)
from tests.support.clocks import use_read_count_clock
from tests.support.workload import BLOCK, PROMPTS, VOCAB

PROMPT_IDS = "1,5,7,9"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("memory"), vocab=VOCAB, block_size=BLOCK)


def generate(pair, memory_dir, *flags: str) -> tuple[list[int], list[dict]]:
    """One ``flashtree generate`` process (ddtree, budget 4, as on a CPU): its tokens and policy trace."""
    trace = memory_dir.parent / f"trace-{len(list(memory_dir.parent.glob('trace-*')))}.jsonl"
    env = {**os.environ, "FLASHTREE_POLICY_CACHE": str(memory_dir)}
    done = subprocess.run([sys.executable, "-m", "flashtree.cli", "generate", "--model", str(pair.target),
                           "--draft", str(pair.drafter), "--budget", "4", "--device", "cpu",
                           "--prompt-ids", PROMPT_IDS, "--max-tokens", "40", "--ignore-eos", "--json",
                           "--trace-policy", str(trace), *flags],
                          check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    tokens = json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]
    return tokens, [json.loads(line) for line in trace.read_text().splitlines()]


def test_generate_processes_keep_and_start_from_the_memory(pair, tmp_path):
    memory = tmp_path / "memory"
    first, first_trace = generate(pair, memory)
    files = list(memory.glob("*.json"))
    assert len(files) == 1 and not list(memory.glob("*.tmp"))
    kept = json.loads(files[0].read_text())
    assert kept["key"]["drafter"]["path"] == str(pair.drafter.resolve()) and kept["key"]["ladder"] == [4, 0]
    assert first_trace[0]["estimates"]["options"][0][1] is None  # nothing known before the first process
    second, second_trace = generate(pair, memory)
    learned = kept["learned"]["acceptance"]["4"][0]
    assert second_trace[0]["estimates"]["options"][0][1] == pytest.approx(learned, abs=1e-3)
    plain, _ = generate(pair, memory, "--spec", "none")
    assert first == second == plain


def test_no_policy_cache_writes_nothing(pair, tmp_path):
    memory = tmp_path / "memory"
    generate(pair, memory, "--no-policy-cache")
    assert not memory.exists()


def oracle_llm(pair, monkeypatch, match: bool, continuations) -> LLM:
    made: list[OracleProposer] = []

    def factory(config, target, tokenizer):
        made.append(OracleProposer(continuations, chain=False, match=match,
                                   delay=0.0 if match else 0.005, pause=clock.sleep))
        return made[-1]

    monkeypatch.setattr(engine_module, "make_proposer", factory)
    clock = use_read_count_clock(monkeypatch)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=BUDGET, **ENGINE)
    made[-1].engine = llm.engine
    llm.engine.policy = RecordingPolicy(llm.engine.policy)
    return llm


@pytest.mark.parametrize("match", [True, False])
def test_an_engine_started_from_the_memory_skips_exploration(pair, monkeypatch, tmp_path, match):
    """Two engines of one setup, one after the other (the first's policy saved as at its exit):
    the second explores no tree, and stays on what the first learned was best."""
    monkeypatch.setenv("FLASHTREE_POLICY_CACHE", str(tmp_path / "memory"))
    plain = LLM(str(pair.target), **ENGINE)
    prompts = [p for p in PROMPTS if len(p) <= ENGINE["prefill_chunk"]][:4]
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    long = plain.generate(prompts, SamplingParams(max_tokens=80 + ORACLE_DEPTH + 1, ignore_eos=True))
    continuations = {tuple(p): o.token_ids for p, o in zip(prompts, long)}
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    chosen = []
    for _ in range(2):
        llm = oracle_llm(pair, monkeypatch, match, continuations)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        policy = llm.engine.policy
        chosen.append(policy.chosen)
        PolicyMemory.for_engine(llm.engine.config, llm.engine.device, llm.engine.dtype).save(policy.policy)
    first, second = chosen
    trees = sorted(n for n in policy.ladder if n)
    assert set(trees) <= set(first)  # the first engine explored every tree
    if match:  # plain's timing first (the relative times wait for it), then the best tree at once
        assert second[:2] == [0, 0] and all(n >= ORACLE_DEPTH for n in second[2:]), second
    else:
        assert Counter(second) == Counter({0: len(second)}), second
