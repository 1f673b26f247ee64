"""``flashtree bench`` on a tiny model: report files and keys, and the flag on inexact methods.
(The method list and prompt sources: tests/unit/test_bench.py.)"""

from __future__ import annotations

import json

import pytest

from flashtree.bench import runner as bench_runner
from flashtree.cli import main
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (fixture)

METHOD_KEYS = {"method", "budget", "tau", "tokens_per_s", "speedup", "exact", "stage_seconds",
               "acceptance_histogram", "mismatched_prompts", "generated_tokens"}
VOCAB = 64
METHODS = "ar,dflash,ddtree:4,ddtree:16"
CONFIG_KEYS = {"model", "dataset", "device", "device_name", "torch", "dtype", "num_prompts", "max_new_tokens"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory):
    """(tiny target + drafter, JSONL prompt file): one prompt, one conversation, raw token ids."""
    root = tmp_path_factory.mktemp("bench")
    pair = tiny_pair(root, vocab=VOCAB, block_size=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "hello world the tree is a flash"},
        {"messages": [{"role": "system", "content": "a tree"}, {"role": "user", "content": "hello world"}]},
        {"prompt_ids": [5, 6, 7, 8, 9]},
    ]) + "\n")
    return pair, prompts


def bench_argv(bench_inputs, out_dir, extra_methods=""):
    pair, prompts = bench_inputs
    return ["bench", "--model", str(pair.target), "--draft", str(pair.drafter), "--methods", METHODS + extra_methods,
            "--dataset", str(prompts), "--num-prompts", "3", "--max-new-tokens", "12", "--ignore-eos",
            "--device", "cpu", "--max-context", "128", "--batch-size", "2", "--warmup-tokens", "2",
            "--json", str(out_dir / "report.json"), "--no-progress"]


def test_bench_writes_json_markdown_and_plots(bench_inputs, tmp_path):
    assert main(bench_argv(bench_inputs, tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert CONFIG_KEYS <= set(report["config"])
    assert report["config"]["num_prompts"] == 3
    labels = [m["method"] for m in report["methods"]]
    assert labels == METHODS.split(",")
    for method in report["methods"]:
        assert METHOD_KEYS <= set(method)
        assert method["exact"] is True and method["generated_tokens"] == 3 * 12
        assert sum(int(k) * v for k, v in method["acceptance_histogram"].items()) >= 3 * 11
    plain = report["methods"][0]
    assert plain["tau"] == 1.0 and plain["speedup"] == 1.0 and plain["budget"] == 0
    assert "verify" in plain["stage_seconds"]
    table = (tmp_path / "report.md").read_text()
    assert "| method | budget | tau | tokens/s | speedup | exact |" in table
    for name in ("report_speedup_tau.png", "report_acceptance.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BROKEN = "ddtree:16"


def break_ddtree16(monkeypatch):
    """The ddtree:16 engine emits a wrong token every third round."""
    real_engine = bench_runner.LLMEngine

    def engine_factory(config, target):
        engine = real_engine(config, target)
        if config.speculation.method == "ddtree" and config.speculation.budget == 16:
            perturb_rounds(engine)
        return engine

    monkeypatch.setattr(bench_runner, "LLMEngine", engine_factory)


def perturb_rounds(engine):
    real_finish = engine.runner.finish  # (where the engine reads every round's tokens)
    vocab = engine.model.config.vocab_size
    calls = []

    def finish_with_wrong_token(launched, *args):
        result = real_finish(launched, *args)
        calls.append(1)
        if len(calls) % 3 == 0:
            result.emitted[0][0] = (result.emitted[0][0] + 1) % vocab
        return result

    engine.runner.finish = finish_with_wrong_token


def test_bench_flags_a_method_whose_tokens_differ(bench_inputs, tmp_path, monkeypatch, capsys):
    break_ddtree16(monkeypatch)
    assert main(bench_argv(bench_inputs, tmp_path)) != 0
    assert f"{BROKEN} produced tokens different from plain decoding" in capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    broken = next(m for m in report["methods"] if m["method"] == BROKEN)
    assert broken["exact"] is False and broken["mismatched_prompts"] and broken["first_divergence"]
    assert report["inexact_methods"] == [BROKEN]
    assert all(m["exact"] for m in report["methods"] if m["method"] != BROKEN)
    table = (tmp_path / "report.md").read_text()
    assert f"| {BROKEN} | 16 |" in table and "**NO (differs from ar)**" in table

    assert main(bench_argv(bench_inputs, tmp_path) + ["--allow-inexact"]) == 0


def test_bench_puts_llamacpp_beside_the_methods(tmp_path):
    """On the embedded GGUF, ``--methods ar,llama.cpp`` decodes the same prompts with llama.cpp; its
    row is reported (with where its tokens part from ours) and never fails the run as inexact."""
    pytest.importorskip("llama_cpp")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    argv = ["bench", "--model", "smollm2", "--methods", "ar,llama.cpp", "--dataset", str(prompts), "--num-prompts", "1",
            "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu", "--max-context", "256", "--batch-size", "1",
            "--warmup-tokens", "2", "--json", str(tmp_path / "report.json"), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    llama = next(m for m in report["methods"] if m["method"] == "llama.cpp")
    assert llama["generated_tokens"] == 8 and llama["tokens_per_s"] > 0 and llama["tau"] == 1.0
    assert report["inexact_methods"] == []


def test_bench_refuses_llamacpp_without_a_gguf(bench_inputs, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    pair, prompts = bench_inputs
    argv = ["bench", "--model", str(pair.target), "--methods", "ar,llama.cpp", "--dataset", str(prompts),
            "--device", "cpu", "--json", str(tmp_path / "report.json"), "--no-progress"]
    assert main(argv) != 0
    assert "needs a GGUF target" in capsys.readouterr().err
