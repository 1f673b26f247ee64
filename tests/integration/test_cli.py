"""The command line: JSON output, prompt ids, and clear errors for bad input. (Flags and settings
alone: tests/unit/test_cli.py.)"""

import json
import subprocess
import sys

import pytest

from flashtree.cli import main
from tests.helpers import tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cli")
    tiny_hf_model("qwen2_bias").save_pretrained(path)
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "flashtree.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_with_prompt_ids(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3", "--max-tokens", "5",
                 "--ignore-eos", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(line["token_ids"]) == 5 and line["text"] == "" and line["acceptance_lengths"] == [1] * 4


def test_missing_path_is_a_clear_error():
    result = run_cli("generate", "--model", "/no/such/model", "--prompt", "hi")
    assert result.returncode == 2
    assert "/no/such/model" in result.stderr and "Traceback" not in result.stderr


def test_bad_prompt_ids(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_prompt_longer_than_context(tiny_dir, capsys):
    ids = ",".join(["3"] * 40)
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", ids, "--max-context", "32"]) == 2
    err = capsys.readouterr().err
    assert "40 tokens" in err and "32" in err


def test_prompt_token_out_of_vocab(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,97"]) == 2
    err = capsys.readouterr().err
    assert "97" in err and "[0, 97)" in err
