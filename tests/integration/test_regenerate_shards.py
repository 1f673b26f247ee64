"""Regeneration at scale: the installed ShareGPT and standard-library code prompts never overlap
the prompts `flashtree bench` sends; the target's answers go into shards that later runs add to
(skipping what is done, dropping what a --max-minutes limit cut off); samples keep their seeds
across runs; train-drafter reads a shard directory and its splits; the commands chain."""

import dataclasses
import gzip
import io
import json

import pytest

import flashtree.train.regenerate as regenerate_module
from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import HUMANEVAL_REQUEST, bench_prompt_texts, load_prompts
from flashtree.train.config import TrainConfig
from flashtree.train.data import (
    DEFAULT_HELDOUT_PERCENT,
    iter_jsonl,
    load_conversations,
    shard_files,
    split_conversations,
    split_fraction,
)
from flashtree.train.prompt_sources import (
    collect_prompts,
    dedup_key,
    export_source_prompts,
    normalized,
)
from flashtree.train.regenerate import RegenerateConfig, regenerate, select_prompts
from flashtree.train.setup import prepare
from tests.dflash_helpers import one_thread  # noqa: F401 (fixture)
from tests.support.clocks import ReadCountClock
from tests.support.train import pair  # noqa: F401 (fixture)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


def test_installed_sources_never_hold_a_bench_prompt(tmp_path):
    bench = bench_prompt_texts()
    humaneval = [p.messages[0]["content"] for p in load_prompts("humaneval", 1000)]
    sharegpt_bench = [p.messages[0]["content"] for p in load_prompts("sharegpt-heldout", 1000)]
    assert len(humaneval) == 164 and len(sharegpt_bench) > 100 and set(humaneval + sharegpt_bench) <= set(bench)
    # a chats file that repeats bench prompts (whitespace changed) must lose them too
    planted = tmp_path / "planted.jsonl"
    with planted.open("w") as handle:
        for i, text in enumerate([humaneval[3], sharegpt_bench[0], "A fresh question."]):
            spaced = text.replace(" ", "  ").replace("\n", " \n") + " "
            handle.write(json.dumps({"id": f"planted{i}", "messages": [{"role": "user", "content": spaced}]}) + "\n")
    prompts, stats = collect_prompts(["sharegpt", "python-functions", str(planted)], bench, heldout_percent=2.0,
                                     turns="all", code_request=HUMANEVAL_REQUEST)
    bench_texts = {normalized(t) for t in bench}
    for prompt in prompts:
        assert not any(normalized(m["content"]) in bench_texts for m in prompt.messages if m["role"] == "user")
        assert split_fraction(prompt.split_key) >= DEFAULT_HELDOUT_PERCENT  # never a chat of the bench's band
    planted_kept = [p.prompt_id for p in prompts if p.source == str(planted)]
    assert planted_kept == ["planted2"]
    by_split = {s: {dedup_key(p.messages) for p in prompts if p.split == s} for s in ("train", "heldout")}
    assert not by_split["train"] & by_split["heldout"]
    assert stats.heldout > 300 and stats.train > 30_000 and stats.bench > 500
    sources = {p.source for p in prompts}
    assert {"sharegpt", "python-functions"} <= sources
    assert sum(p.source == "python-functions" for p in prompts) > 2000


def chats_file(path, count):
    with path.open("w") as handle:
        for i in range(count):
            handle.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"w{i % 7} w{(3 * i) % 11} hello {i}"},
                {"role": "assistant", "content": "w1 w2"}]}) + "\n")
    return path


def append_cut_line(path, text: str) -> None:
    """What a killed writer leaves: ``text`` with no newline, and in a gzip shard a stream without its end."""
    if path.suffix != ".gz":
        with path.open("a") as handle:
            handle.write(text)
        return
    stream = io.BytesIO()
    member = gzip.GzipFile(fileobj=stream, mode="wb", mtime=0)
    member.write(text.encode())
    member.flush()  # (never closed: no end-of-stream marker)
    with path.open("ab") as handle:
        handle.write(stream.getvalue())


def read_dir(directory):
    return [r for path in shard_files(directory) for _, r in iter_jsonl(path)]


def test_regenerate_into_shards_resumes_without_repeats(pair, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    export_source_prompts(prompts, [str(chats_file(tmp_path / "chats.jsonl", 40))], heldout_percent=20.0)
    exported = [r for _, r in iter_jsonl(prompts)]
    assert {r["split"] for r in exported} == {"train", "heldout"}
    out = tmp_path / "regen"
    cfg = RegenerateConfig(prompts=str(prompts), output=str(out), split="all", limit=7, max_new_tokens=6,
                           temperature=0.0, progress=False, shard_mb=0.0003)  # ~300-byte gzip shards
    llm = LLM(str(pair.target), max_running=4, max_context=128)
    assert regenerate(llm, select_prompts(cfg), cfg).answered == 7
    first_shards = {p.name: p.read_bytes() for p in shard_files(out)}
    assert len(first_shards) > 1
    assert all(p.name.endswith(".jsonl.gz") for p in shard_files(out))  # gzip shards by default
    append_cut_line(shard_files(out)[-1], '{"id": "c39", "messa')  # a run killed mid-line: c39 is not done
    rest = dataclasses.replace(cfg, limit=None)
    todo = select_prompts(rest)
    assert len(todo) == len(exported) - 7
    assert regenerate(llm, todo, rest).answered == len(todo)
    assert all(p.read_bytes() == first_shards[p.name] for p in shard_files(out) if p.name in first_shards
               and p != shard_files(out)[len(first_shards) - 1])  # earlier shards are never rewritten
    records = read_dir(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in exported)  # each once
    split_of = {r["id"]: r["split"] for r in exported}
    for record in records[:5]:
        *history, answer = record["messages"]
        assert record["split"] == split_of[record["id"]] and record["source"] == str(tmp_path / "chats.jsonl")
        assert answer["content"] == llm.chat([history], SamplingParams(max_tokens=6))[0].text
    assert select_prompts(rest) == []

    # train-drafter reads the directory and splits by the records' field
    tcfg = TrainConfig(model=str(pair.target), data=str(out), output=str(tmp_path / "d"), layers=1, block_size=4,
                       max_seq_len=64, batch_size=4, anchors_per_seq=8, steps=1, heldout_percent=0, progress=False)
    setup = prepare(tcfg)
    held = {r["id"] for r in exported if r["split"] == "heldout"}
    train, heldout = split_conversations(load_conversations(str(out)), heldout_percent=0)
    assert {c.conv_id for c in heldout} == held and not held & {c.conv_id for c in train}
    assert setup.heldout_samples and {s.conv_id for s in setup.heldout_samples} <= held  # (a 1-token answer has no
    assert not held & {s.conv_id for s in setup.train_samples}  # anchor: the encoder drops it)


def test_samples_keep_their_seeds_and_max_minutes_drops_the_unfinished(pair, tmp_path, monkeypatch):  # noqa: F811
    chats = chats_file(tmp_path / "chats.jsonl", 6)
    llm = LLM(str(pair.target), max_running=4, max_context=128)
    whole = RegenerateConfig(prompts=str(chats), output=str(tmp_path / "whole"), split="all", max_new_tokens=8,
                             temperature=1.0, samples=3, progress=False)
    assert regenerate(llm, select_prompts(whole), whole).answered == 18
    answers = {r["id"]: r["messages"][-1]["content"] for r in read_dir(whole.output)}
    assert "c0~s2" in answers and len(set(answers.values())) > 6  # samples differ

    clock = ReadCountClock(tick=1.0)
    monkeypatch.setattr(regenerate_module, "time", clock)
    cut = dataclasses.replace(whole, output=str(tmp_path / "cut"), max_minutes=0.4)
    stats = regenerate(llm, select_prompts(cut), cut, started_at=clock.perf_counter())
    assert 0 < stats.answered < 18 and stats.answered + stats.dropped <= 18
    assert clock.now < 0.4 * 60 + 5  # stopped at the limit (one engine step past it at most)
    monkeypatch.undo()
    rest = dataclasses.replace(cut, max_minutes=None)
    assert regenerate(llm, select_prompts(rest), rest).answered == 18 - stats.answered
    again = {r["id"]: r["messages"][-1]["content"] for r in read_dir(rest.output)}
    assert again == answers  # an answer's seed comes from its id: the same texts over two runs


def test_commands_chain_export_regenerate_train(pair, tmp_path, capsys):  # noqa: F811
    from flashtree.cli import main

    code = tmp_path / "code"
    code.mkdir()
    (code / "lib.py").write_text('def mean(xs):\n    """The arithmetic mean of a non-empty list of numbers."""\n'
                                 '    return sum(xs) / len(xs)\n')
    chats = chats_file(tmp_path / "chats.jsonl", 24)
    assert main(["export-prompts", "--sources", f"{chats},python-functions:{code}", "--heldout-percent", "10",
                 "--output", str(tmp_path / "p.jsonl")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = summary["train"] + summary["heldout"]
    assert summary["read"] == 25 and kept == 25 - summary["bench"] > 20 and summary["heldout"] > 0
    regen = ["regenerate", "--model", str(pair.target), "--prompts", str(tmp_path / "p.jsonl"), "--split", "all",
             "--max-new-tokens", "6", "--temperature", "0", "--max-running", "4", "--max-context", "256",
             "--output", str(tmp_path / "regen"), "--no-progress"]
    assert main([*regen, "--limit", "10"]) == 0 and main(regen) == 0
    assert len(read_dir(tmp_path / "regen")) == kept
    assert main(["train-drafter", "--model", str(pair.target), "--data", str(tmp_path / "regen"), "--output",
                 str(tmp_path / "d"), "--layers", "1", "--block-size", "4", "--steps", "2", "--batch-size", "4",
                 "--anchors-per-seq", "8", "--max-seq-len", "128", "--loss-gamma", "0", "--intermediate-size", "32",
                 "--no-progress"]) == 0
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["intermediate_size"] == 32
