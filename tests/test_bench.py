"""``flashtree bench`` on a tiny model: report files and keys, and the flag on inexact methods."""

from __future__ import annotations

import json

import pytest

from flashtree.bench import methods as bench_methods
from flashtree.bench import runner as bench_runner
from flashtree.bench.datasets import humaneval_prompts, jsonl_prompts
from flashtree.bench.methods import BenchMethod, parse_methods
from flashtree.cli import main
from flashtree.errors import ConfigError
from tests.helpers import tiny_hf_model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
METHOD_KEYS = {"method", "budget", "tau", "tokens_per_s", "speedup", "exact", "stage_seconds",
               "acceptance_histogram", "mismatched_prompts", "generated_tokens"}
CONFIG_KEYS = {"model", "dataset", "device", "device_name", "torch", "dtype", "num_prompts", "max_new_tokens"}


def save_tiny_tokenizer(path, vocab_size: int) -> None:
    """A character-level tokenizer with a chat template, ids < ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    symbols = [chr(c) for c in range(33, 127)][: vocab_size - len(specials)]
    vocab = {token: i for i, token in enumerate(specials + symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                        additional_special_tokens=specials[1:], chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def bench_inputs(tmp_path_factory):
    """(model directory, JSONL prompt file, methods) for the tiny model; with a drafter when
    tests/dflash_helpers.py provides one."""
    root = tmp_path_factory.mktemp("bench")
    model_dir, draft_args, methods = tiny_target_and_methods(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "def add(a, b): return a + b"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there !"}]},
        {"prompt_ids": [5, 6, 7, 8, 9]},
    ]) + "\n")
    return model_dir, prompts, draft_args, methods


def tiny_target_and_methods(root):
    try:
        from tests.dflash_helpers import tiny_pair
    except ImportError:
        tiny_pair = None
    if tiny_pair is None:
        model_dir = root / "target"
        tiny_hf_model("llama_gqa").save_pretrained(model_dir)
        save_tiny_tokenizer(model_dir, 97)
        return model_dir, [], "ar"
    target_dir, draft_dir = tiny_pair(root)[:2]
    from flashtree.models.loader import load_tokenizer

    if load_tokenizer(target_dir) is None:
        save_tiny_tokenizer(target_dir, 97)
    return target_dir, ["--draft", str(draft_dir)], "ar,dflash,ddtree:4,ddtree:8"


def bench_argv(bench_inputs, out_dir, extra_methods=""):
    model_dir, prompts, draft_args, methods = bench_inputs
    return ["bench", "--model", str(model_dir), *draft_args, "--methods", methods + extra_methods,
            "--dataset", str(prompts), "--num-prompts", "3", "--max-new-tokens", "12", "--ignore-eos",
            "--device", "cpu", "--max-context", "128", "--batch-size", "2", "--warmup-tokens", "2",
            "--json", str(out_dir / "report.json"), "--no-progress"]


def test_bench_writes_json_markdown_and_plots(bench_inputs, tmp_path):
    assert main(bench_argv(bench_inputs, tmp_path)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert CONFIG_KEYS <= set(report["config"])
    assert report["config"]["num_prompts"] == 3
    labels = [m["method"] for m in report["methods"]]
    assert labels == bench_inputs[3].split(",")
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


def install_broken_method(monkeypatch):
    """A method ``broken``: plain decoding whose engine emits a wrong token now and then."""
    real_parse = bench_methods.parse_method
    monkeypatch.setattr(bench_methods, "parse_method",
                        lambda text: BenchMethod("broken", "none") if text == "broken" else real_parse(text))
    built = []

    def engine_factory(config, target):
        engine = real_engine(config, target)
        built.append(engine)
        if len(built) == 2:  # plain decoding runs first, then "broken"
            perturb_rounds(engine)
        return engine

    real_engine = bench_runner.LLMEngine
    monkeypatch.setattr(bench_runner, "LLMEngine", engine_factory)


def perturb_rounds(engine):
    real_round = engine.runner.round
    vocab = engine.model.config.vocab_size
    calls = []

    def round_with_wrong_token(rows):
        result = real_round(rows)
        calls.append(1)
        if len(calls) % 3 == 0:
            result.emitted[0][0] = (result.emitted[0][0] + 1) % vocab
        return result

    engine.runner.round = round_with_wrong_token


def test_bench_flags_a_method_whose_tokens_differ(bench_inputs, tmp_path, monkeypatch, capsys):
    install_broken_method(monkeypatch)
    assert main(bench_argv(bench_inputs, tmp_path, ",broken")) != 0
    assert "broken produced tokens different from plain decoding" in capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    broken = next(m for m in report["methods"] if m["method"] == "broken")
    assert broken["exact"] is False and broken["mismatched_prompts"]
    assert report["inexact_methods"] == ["broken"]
    assert all(m["exact"] for m in report["methods"] if m["method"] != "broken")
    assert "| broken |" in (tmp_path / "report.md").read_text()
    assert "**NO (differs from ar)**" in (tmp_path / "report.md").read_text()

    assert main(bench_argv(bench_inputs, tmp_path, ",broken") + ["--allow-inexact"]) == 0


def test_parse_methods_puts_plain_first_and_validates():
    parsed = parse_methods("ddtree:64,dflash")
    assert [m.label for m in parsed] == ["ar", "ddtree:64", "dflash"]
    assert parsed[1].budget == 64 and parsed[2].spec_method == "dflash"
    for bad in ("ddtree:0", "ddtree:x", "medusa", "ar,ar", ""):
        with pytest.raises(ConfigError):
            parse_methods(bad)


def test_prompt_sources(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        jsonl_prompts(bad)
    problems = humaneval_prompts(2)
    assert len(problems) == 2 and "def " in problems[0].messages[0]["content"]
