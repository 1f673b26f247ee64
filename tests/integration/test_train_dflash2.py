"""``flashtree train-drafter --arch dflash2``: a DFlash2 drafter trained on the successor target's
chats reaches high acceptance (held out and in the engine, as the DFlash chain and as DDTree,
losslessly), its checkpoint is the public DFlash2 format and loads, and a resume continues it.
The pieces (forward, loss, new drafter): tests/unit/test_train_dflash2.py."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.speculative.dflash import DFlashProposer
from flashtree.train.config import TrainConfig
from flashtree.train.trainer import train
from tests.dflash_helpers import one_thread  # noqa: F401 (a fixture)
from tests.support.train import save_successor_target, successor_chats

pytestmark = pytest.mark.usefixtures("one_thread")

CHATS = [[{"role": "user", "content": "w3 w5"}], [{"role": "user", "content": "hello world tree"}]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DFlash2 drafter trained through the command line on chats of the successor target
    (greedy output: w0 w1 .. w7 w0 ..)."""
    from flashtree.cli import main

    tmp = tmp_path_factory.mktemp("successor2")
    torch.set_num_threads(1)
    target, _ = save_successor_target(tmp / "target", cycle=8)
    chats = successor_chats(tmp / "chats.jsonl", 160, cycle=8)
    args = ["train-drafter", "--arch", "dflash2", "--model", str(target), "--data", str(chats),
            "--output", str(tmp / "drafter"), "--layers", "2", "--block-size", "8", "--target-layer-ids", "1,3",
            "--max-seq-len", "96", "--batch-size", "8", "--anchors-per-seq", "32", "--steps", "70", "--lr", "3e-3",
            "--warmup", "10", "--eval-every", "0", "--heldout-percent", "10", "--no-progress"]
    assert main(args) == 0
    return str(target), tmp / "drafter"


def test_trained_dflash2_drafter_accepts_in_the_engine(trained):
    target, drafter = trained
    metrics = json.loads((drafter / "train_metrics.json").read_text())
    heldout = metrics["history"][-1]
    assert heldout["split"] == "heldout" and heldout["tau"] > 3.0, metrics
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = LLM(target, max_running=4, max_context=256).chat(CHATS, params)
    for spec, budget in (("dflash", None), ("ddtree", 8)):
        llm = LLM(target, spec=spec, draft=str(drafter), budget=budget, max_running=4, max_context=256,
                  adaptive_spec=False)  # every round drafts (the acceptance is the drafter's)
        assert isinstance(llm.engine.proposer.runner.drafter, DFlash2Drafter)
        outs = llm.chat(CHATS, params)
        for out, ref in zip(outs, plain):
            assert out.token_ids == ref.token_ids  # lossless, whatever the drafter
            assert out.mean_acceptance_length > 3.0, (spec, out.acceptance_lengths)
        if isinstance(llm.engine.proposer, DFlashProposer):
            assert llm.engine.proposer.max_nodes == 7


def test_checkpoint_is_the_public_dflash2_format(trained):
    _, drafter = trained
    raw = json.loads((drafter / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["is_causal"] is False
    draft = raw["dflash_config"]
    assert draft["block_size"] == 8 and draft["target_layer_ids"] == [1, 3]
    assert (draft["conv_kernel_size"], draft["conv_group_size"], draft["selector_rank"], draft["selector_top_k"]) == (
        2, 16, 256, 16)
    from safetensors import safe_open

    with safe_open(str(drafter / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice("candidate_selector.predecessor_codebook").get_shape() == [48, 256]
        assert handle.get_slice("layers.1.mlp_conv.kernel_projection.weight").get_shape() == [2 * 2 * 4, 64]
    assert {"candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel"} <= names
    assert not any("embed" in name or "lm_head" in name for name in names)


def test_resume_continues_a_dflash2_run(trained, tmp_path):
    _, drafter = trained
    state = json.loads((drafter / "trainer_state" / "state.json").read_text())
    cfg = dataclasses.replace(TrainConfig(**{k: tuple(v) if k == "target_layer_ids" else v
                                             for k, v in state["train_config"].items()}),
                              resume=str(drafter), output=str(tmp_path / "resumed"), steps=73, progress=False)
    result = train(cfg)
    assert result.steps == 73 and result.heldout["tau"] > 3.0
    assert json.loads((Path(cfg.output) / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
