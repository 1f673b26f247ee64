"""Drafter training runs: the loss falls, a trained drafter reaches high acceptance in the real
engine, checkpoints load, resume, stop early and regenerate work, and the commands run. The
training forward, masks, loss and mask-token rules: tests/unit/test_train_drafter.py."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.build import build_model
from flashtree.models.dflash import load_drafter
from flashtree.models.loader import load_checkpoint, read_weights
from flashtree.train import trainer_state
from flashtree.train.config import TrainConfig
from flashtree.train.regenerate import RegenerateConfig, regenerate, select_prompts
from flashtree.train.setup import prepare
from flashtree.train.trainer import train, train_step
from tests.dflash_helpers import one_thread  # noqa: F401 (fixture)
from tests.support.clocks import ReadCountClock
from tests.support.train import pair, save_successor_target, successor_chats  # noqa: F401 (pair: a fixture)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


def random_chats(path, count, seed=0):
    rng = random.Random(seed)
    words = ["hello", "world", "flash", "tree", "the", "a", "is"] + [f"w{i}" for i in range(12)]
    with path.open("w") as handle:
        for i in range(count):
            turns = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 20))) for _ in range(2)]
            handle.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": turns[0]},
                                                                 {"role": "assistant", "content": turns[1]}]}) + "\n")
    return path


def test_loss_falls_on_a_tiny_random_target(pair, tmp_path):
    chats = random_chats(tmp_path / "chats.jsonl", 64)
    cfg = TrainConfig(model=str(pair.target), data=str(chats), output=str(tmp_path / "d"), layers=1, block_size=4,
                      max_seq_len=64, batch_size=8, anchors_per_seq=16, steps=40, lr=3e-3, warmup=5,
                      heldout_percent=0, progress=False)
    setup = prepare(cfg)
    batches = setup.stream.iterate()
    generator = torch.Generator().manual_seed(0)
    losses = [train_step(setup, next(batches), generator, cfg.lr).loss.item() for _ in range(cfg.steps)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.4, losses  # random words: the floor is their entropy, about ln(19) = 2.9


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter trained on chats of the successor target (greedy output: w0 w1 .. w7 w0 ..)."""
    tmp = tmp_path_factory.mktemp("successor")
    torch.set_num_threads(1)
    target, _ = save_successor_target(tmp / "target", cycle=8)
    chats = successor_chats(tmp / "chats.jsonl", 160, cycle=8)
    cfg = TrainConfig(model=str(target), data=str(chats), output=str(tmp / "drafter"), layers=2, block_size=8,
                      target_layer_ids=(1, 3), max_seq_len=96, batch_size=8, anchors_per_seq=32, steps=70,
                      lr=3e-3, warmup=10, eval_every=0, heldout_percent=10, progress=False)
    return cfg, train(cfg)


def test_trained_drafter_reaches_high_acceptance_in_the_engine(trained):
    cfg, result = trained
    assert result.heldout["tau"] > 3.0, result.summary()
    llm = LLM(cfg.model, spec="dflash", draft=cfg.output, max_running=4, max_context=256)
    chats = [[{"role": "user", "content": "w3 w5"}], [{"role": "user", "content": "hello world tree"}]]
    outs = llm.chat(chats, SamplingParams(max_tokens=48, ignore_eos=True))
    plain = LLM(cfg.model, max_running=4, max_context=256).chat(chats, SamplingParams(max_tokens=48, ignore_eos=True))
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids  # lossless, whatever the drafter
        assert out.mean_acceptance_length > 3.0, out.acceptance_lengths


def test_checkpoint_is_zlab_format_and_loads(trained):
    cfg, result = trained
    raw = json.loads((Path(cfg.output) / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 8 and raw["num_target_layers"] == 4
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3]
    assert raw["dflash_config"]["mask_token_id"] == 46 and raw["dflash_config"]["mask_token"] == "<|MASK|>"
    weights = read_weights(Path(cfg.output))
    assert not any("embed" in name or "lm_head" in name for name in weights)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert (Path(cfg.output) / "trainer_state" / "state.json").is_file()
    assert (Path(cfg.output) / "train_curve.png").stat().st_size > 1000
    ckpt = load_checkpoint(cfg.model)
    target = build_model(ckpt.config, ckpt.weights, torch.device("cpu"), torch.float32)
    drafter = load_drafter(cfg.output, target, ckpt.tokenizer)
    assert drafter.config.block_size == 8 and drafter.config.mask_token_id == 46


def test_resume_continues_and_shards(trained, tmp_path):
    cfg, result = trained
    more = dataclasses.replace(cfg, resume=cfg.output, output=str(tmp_path / "resumed"), steps=result.steps + 3,
                               max_shard_mb=0.05)
    again = train(more)
    assert again.steps == result.steps + 3
    out = Path(more.output)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    ckpt = load_checkpoint(cfg.model)
    target = build_model(ckpt.config, ckpt.weights, torch.device("cpu"), torch.float32)
    load_drafter(more.output, target, ckpt.tokenizer)
    assert again.heldout["tau"] > 3.0


def test_regenerate_writes_target_answers(pair, tmp_path):
    prompts = random_chats(tmp_path / "prompts.jsonl", 6)
    cfg = RegenerateConfig(prompts=str(prompts), output=str(tmp_path / "regen.jsonl"), split="all",
                           max_new_tokens=8, temperature=0.0, progress=False)
    llm = LLM(str(pair.target), max_running=4, max_context=128)
    stats = regenerate(llm, select_prompts(cfg), cfg)
    records = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert stats.answered == len(records) == 6 and stats.skipped == 0
    assert sorted(r["id"] for r in records) == [f"r{i}" for i in range(6)]
    for record in records:
        user, answer = record["messages"]
        expected = llm.chat([user], SamplingParams(max_tokens=8))[0]
        assert answer == {"role": "assistant", "content": expected.text}
        assert record["num_tokens"] == len(expected.token_ids)


def test_regenerate_answers_every_turn_and_appends_across_runs(pair, tmp_path):
    """Exported all-turn prompts are answered after their history; --append resumes: a second
    run answers only the ids the first did not, and nothing is answered twice."""
    from flashtree.train.data import export_prompts

    chats = tmp_path / "chats.jsonl"
    with chats.open("w") as handle:
        for i in range(4):
            handle.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"{i} {i}"}, {"role": "assistant", "content": "1 2 3"},
                {"role": "user", "content": f"{i + 1}"}]}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    assert export_prompts(prompts, source=str(chats), split="all", max_prompt_tokens=None, turns="all",
                          max_chars=100) == 8
    llm = LLM(str(pair.target), max_running=4, max_context=128)
    first = RegenerateConfig(prompts=str(prompts), output=str(tmp_path / "regen.jsonl"), split="all", limit=3,
                             max_new_tokens=6, temperature=0.0, progress=False, append=True)
    assert regenerate(llm, select_prompts(first), first).answered == 3
    rest = dataclasses.replace(first, limit=None)
    assert len(select_prompts(rest)) == 5
    assert regenerate(llm, select_prompts(rest), rest).answered == 5
    records = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted([f"c{i}" for i in range(4)] + [f"c{i}#turn1" for i in range(4)])
    for record in records:
        *history, answer = record["messages"]
        assert len(history) == (3 if "#turn" in record["id"] else 1)
        assert record["train_from"] == len(history)  # only the new answer is the target's own
        expected = llm.chat([history], SamplingParams(max_tokens=6))[0]
        assert answer == {"role": "assistant", "content": expected.text}


def test_cli_commands(pair, tmp_path, capsys):
    from flashtree.cli import main

    chats = random_chats(tmp_path / "chats.jsonl", 12)
    assert main(["export-prompts", "--data", str(chats), "--split", "all", "--output", str(tmp_path / "p.jsonl")]) == 0
    assert main(["regenerate", "--model", str(pair.target), "--prompts", str(tmp_path / "p.jsonl"), "--split", "all",
                 "--max-new-tokens", "4", "--temperature", "0", "--max-running", "4", "--max-context", "128",
                 "--output", str(tmp_path / "regen.jsonl"), "--no-progress"]) == 0
    assert main(["train-drafter", "--model", str(pair.target), "--data", str(tmp_path / "regen.jsonl"),
                 "--output", str(tmp_path / "d"), "--layers", "1", "--block-size", "4", "--steps", "3",
                 "--batch-size", "4", "--anchors-per-seq", "8", "--max-seq-len", "64", "--heldout-percent", "0",
                 "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and (tmp_path / "d" / "model.safetensors").is_file()
    assert main(["train-drafter", "--model", str(pair.target), "--data", str(chats), "--block-size", "1"]) == 2


def test_stop_after_saves_and_resume_counts_earlier_time(trained, tmp_path, monkeypatch):
    """--stop-after-s ends this run early (saved, resumable); a resume counts the earlier runs'
    wall time against --time-budget-s, so the schedule and the stop follow the whole training.
    The trainer's clock advances 0.1 s per read (tests/support/clocks.py): the run stops after the
    same few steps on every machine."""
    import flashtree.train.trainer as trainer_module

    cfg, result = trained
    monkeypatch.setattr(trainer_module, "time", ReadCountClock(tick=0.1))
    first = dataclasses.replace(cfg, resume=cfg.output, output=str(tmp_path / "part"), steps=result.steps + 10_000,
                                time_budget_s=3600.0, stop_after_s=0.5)
    part = train(first)
    assert part.stopped_by == "stop_after" and result.steps < part.steps < result.steps + 10_000
    spent = trainer_state.load(first.output).elapsed_s
    over = dataclasses.replace(first, resume=first.output, output=str(tmp_path / "over"), time_budget_s=spent * 0.5,
                               stop_after_s=None)
    done = train(over)
    assert done.stopped_by == "time" and done.steps == part.steps  # the budget was already spent
