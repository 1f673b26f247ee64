"""The z-lab DFlash drafter format in the engine: the engine feeds the drafter the committed
context (every draft equals the independent reference of tests/support/dflash_reference.py), the
CPU's Q8_0 drafter copy keeps the tokens, both config layouts generate, and a mismatched pair is
refused before generation (library and command line). The format's rules and forward:
tests/unit/test_dflash_format.py."""

from __future__ import annotations

import json

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.cli import main as cli_main
from flashtree.errors import ConfigError
from flashtree.speculative.dflash import DFlashProposer
from tests.dflash_helpers import one_thread, save_tiny_drafter, tiny_pair  # noqa: F401 (fixture)
from tests.support.clocks import use_read_count_clock
from tests.support.dflash_reference import reference_draft_logits

VOCAB = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"), vocab=VOCAB)


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def test_engine_feeds_drafter_the_committed_context(pair, monkeypatch):
    """Through the engine (chunked prefill, DDTree rounds, several rows), every draft equals the
    reference computed from the request's committed tokens and bonus (with the checkpoint's
    weights: the CPU's Q8_0 drafter copy is off, see test_quantized_drafter_stays_close). The
    engine's clock counts its reads (tests/support/clocks.py), so the adaptive policy drafts the same
    rounds on every machine."""
    use_read_count_clock(monkeypatch)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=16, max_running=4,
              max_context=64, prefill_chunk=4, quant_kernels=False)
    runner = llm.engine.proposer.runner
    seen = []
    real = runner.draft_logits

    def recording(rows, depth=None):
        logits = real(rows, depth)
        by_slot = {r.slot: r for r in llm.engine.scheduler.active}
        for row, slot in enumerate(rows.slots.tolist()):
            req = by_slot[slot]
            committed = req.prompt_ids + req.output_ids[:-1]
            assert len(committed) == int(rows.starts[row])
            seen.append((committed, req.output_ids[-1], logits[row]))
        return logits

    monkeypatch.setattr(runner, "draft_logits", recording)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4], [7, 7, 7, 7, 7, 7]],
                 SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(seen) >= 6
    for committed, bonus, logits in seen:
        reference = reference_draft_logits(pair.hf, pair.drafter, committed, bonus)
        assert (logits - reference[:len(logits)]).abs().max() < 1e-4


def test_quantized_drafter_stays_close(pair):
    """CPU: the drafter rounded to Q8_0 (the default with the C++ kernels) drafts within Q8_0's
    rounding of the checkpoint drafter, and its block products equal its fp32 products (the fp32
    weights are the blocks' values), so the drafter's state does not depend on how many tokens a
    pass carries."""
    from flashtree.kernels.cpu import fused as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the CPU kernel library does not build here")
    exact = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=4, quant_kernels=False)
    rounded = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=4)
    drafter = rounded.engine.proposer.runner.drafter
    assert drafter.fc_quant is not None and exact.engine.proposer.runner.drafter.fc_quant is None
    layer = drafter.layers[0].mlp
    x = torch.randn(5, layer.gate_up.shape[1])
    assert (layer.gate_up_quant(x) - x @ layer.gate_up.T).abs().max() < 1e-4
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4]]
    assert [o.token_ids for o in rounded.generate(prompts, params)] == [o.token_ids for o in exact.generate(prompts, params)]


@pytest.mark.parametrize("layout", ["rope_theta", "rope_parameters"])
def test_both_layouts_generate(pair, tmp_path, layout):
    directory = save_tiny_drafter(pair.target, tmp_path / layout, layout=layout, block_size=3)
    raw = json.loads((directory / "config.json").read_text())
    assert ("rope_parameters" in raw) == (layout == "rope_parameters")
    llm = LLM(str(pair.target), spec="dflash", draft=str(directory), max_context=64)
    assert isinstance(llm.engine.proposer, DFlashProposer)
    assert llm.engine.proposer.max_depth == 2 and llm.engine.proposer.capture_layers == (0, 1)
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_mismatched_pair_refused_before_generation(pair, tmp_path, capsys):
    other = tiny_pair(tmp_path, family="llama_gqa", vocab=VOCAB, target_layers=2)
    with pytest.raises(ConfigError) as info:
        LLM(str(pair.target), spec="ddtree", draft=str(other.drafter))
    msg = str(info.value)
    assert str(other.drafter) in msg and "'num_target_layers' = 2" in msg and "3 layers" in msg
    argv = ["generate", "--model", str(pair.target), "--spec", "dflash", "--draft", str(other.drafter),
            "--prompt-ids", "1,2,3", "--json"]
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    assert "num_target_layers" in captured.err and captured.out == ""
