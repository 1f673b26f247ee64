"""Stop-and-resume is lossless: 2 x N steps with a stop in the middle give, bit for bit, the
weights and optimizer state of one run of 2N steps (float32 on the CPU); the trainer state is
safetensors shards of at most 16 MiB plus JSON, readable without flashtree; --max-minutes stops
and saves in time; the curve PNG is written at every save."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import safetensors
import torch

import flashtree.train.deadline as deadline_module
import flashtree.train.trainer as trainer_module
from flashtree.errors import ConfigError
from flashtree.train import trainer_state
from flashtree.train.config import TrainConfig
from flashtree.train.trainer import train
from tests.dflash_helpers import one_thread  # noqa: F401 (fixture)
from tests.support.clocks import ReadCountClock
from tests.support.train import pair  # noqa: F401 (fixture)

MIB = 1024 * 1024


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


def word_chats(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["hello", "world", "flash", "tree", "the", "a", "is"] + [f"w{i}" for i in range(12)]
    with path.open("w") as handle:
        for i in range(count):
            user, answer = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 24))) for _ in range(2))
            handle.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": user},
                                                                 {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(pair, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("resume")
    chats = word_chats(tmp / "chats.jsonl", 40)
    # 12 steps over 9 batches an epoch: the stop (step 6) and an epoch boundary (step 9) both fall
    # inside; held-out evals every 4 steps draw from their own generator between training steps
    return TrainConfig(model=str(pair.target), data=str(chats), output=str(tmp / "whole"), layers=1, block_size=4,
                       max_seq_len=64, batch_size=4, anchors_per_seq=8, steps=12, lr=3e-3, warmup=3,
                       heldout_percent=10, eval_every=4, eval_batches=2, log_every=2, save_dtype="float32",
                       progress=False, seed=3)


def test_stop_and_resume_gives_the_weights_of_one_uninterrupted_run(base, tmp_path):
    whole = train(base)
    assert whole.stopped_by == "steps" and whole.steps == 12
    halves = dataclasses.replace(base, output=str(tmp_path / "halves"), stop_after_steps=6)
    first = train(halves)
    assert first.stopped_by == "stop_after_steps" and first.steps == 6
    torch.manual_seed(1234)  # whatever a new process would have: the resume restores every RNG
    random.seed(99)
    second = train(dataclasses.replace(halves, resume=halves.output, stop_after_steps=None))
    assert second.stopped_by == "steps" and second.steps == 12

    a, b = trainer_state.load(base.output), trainer_state.load(halves.output)
    assert a.model.keys() == b.model.keys()
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
    for index, per_param in a.optimizer["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, b.optimizer["state"][index][key]), (index, key)
    assert a.data_position == b.data_position and a.data_position["epoch"] == 1
    assert torch.equal(a.rng["anchors"], b.rng["anchors"])
    assert whole.heldout == second.heldout
    # the history carries on across the stop: the same train windows and evals, plus the stop's eval
    def points(history, split):
        return [(h["step"], h["loss"], h["tau"]) for h in history if h["split"] == split]

    assert points(b.history, "train") == points(a.history, "train")
    assert [p for p in points(b.history, "heldout") if p[0] != 6] == points(a.history, "heldout")


def test_a_resume_without_the_saved_rng_takes_another_path(base, tmp_path):
    """The check above has teeth: the same stop and resume with the anchor generator's saved state
    replaced by a fresh one ends with other weights."""
    halves = dataclasses.replace(base, output=str(tmp_path / "halves"), stop_after_steps=6)
    train(halves)
    state = trainer_state.load(halves.output)
    state.rng["anchors"] = torch.Generator().manual_seed(0).get_state()
    trainer_state.save(halves.output, state)
    train(dataclasses.replace(halves, resume=halves.output, stop_after_steps=None))
    whole = train(dataclasses.replace(base, output=str(tmp_path / "whole")))
    a, b = trainer_state.load(whole.output).model, trainer_state.load(halves.output).model
    assert any(not torch.equal(a[n], b[n]) for n in a)


def test_trainer_state_is_small_safetensors_shards_and_json(base, tmp_path):
    cfg = dataclasses.replace(base, output=str(tmp_path / "d"), steps=2, eval_every=0)
    train(cfg)
    folder = Path(cfg.output) / "trainer_state"
    files = sorted(p.name for p in folder.iterdir())
    assert "state.json" in files and all(f == "state.json" or f.endswith(".safetensors") for f in files)
    assert not (Path(cfg.output) / "trainer_state.pt").exists()
    meta = json.loads((folder / "state.json").read_text())  # no flashtree class needed: json ...
    assert meta["step"] == 2 and meta["train_config"]["seed"] == 3 and meta["data_position"]["batch"] == 2
    count = 0
    for entry in meta["tensors"].values():  # ... and safetensors
        for file, key in entry["parts"]:
            assert (folder / file).stat().st_size <= 16 * MIB
            with safetensors.safe_open(str(folder / file), "pt") as handle:
                count += handle.get_tensor(key).numel()
    state = trainer_state.load(cfg.output)
    assert count == sum(t.numel() for t in state.model.values()) + sum(
        t.numel() for p in state.optimizer["state"].values() for t in p.values()) + sum(
        state.rng[k].numel() for k in ("torch_cpu", "anchors"))


def test_resume_refuses_other_data(base, tmp_path):
    cfg = dataclasses.replace(base, output=str(tmp_path / "d"), steps=2, eval_every=0)
    train(cfg)
    other = word_chats(tmp_path / "other.jsonl", 40, seed=1)
    with pytest.raises(ConfigError, match="not the data of the run being resumed"):
        train(dataclasses.replace(cfg, resume=cfg.output, data=str(other), steps=4))
    fresh = train(dataclasses.replace(cfg, init=cfg.output, output=str(tmp_path / "e"), data=str(other), steps=1))
    assert fresh.steps == 1  # --init: the weights only, a new run on the new data


def test_max_minutes_stops_and_saves_before_the_limit(base, tmp_path, monkeypatch):
    """The trainer's clock advances 0.1 s a read: the stop leaves the measured step and finishing
    time (with its safety factor) before the limit, and the run resumes from the save."""
    clock = ReadCountClock(tick=0.1)
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(deadline_module, "time", clock)
    cfg = dataclasses.replace(base, output=str(tmp_path / "d"), steps=10_000, max_minutes=0.5, eval_every=0)
    result = train(cfg, started_at=clock.perf_counter())
    assert result.stopped_by == "max_minutes" and 1 < result.steps < 10_000
    assert clock.now < 0.5 * 60  # the save and final eval were inside the limit
    assert trainer_state.load(cfg.output).step == result.steps
    more = train(dataclasses.replace(cfg, resume=cfg.output, max_minutes=None, steps=result.steps + 2))
    assert more.steps == result.steps + 2
