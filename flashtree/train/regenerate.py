"""``flashtree regenerate``: answer prompts with the TARGET itself and write the chats as JSONL.

A drafter imitates its target best when trained on the target's own answers (the published
DFlash drafters were trained this way). Prompts go through our engine: the records of a
prompts file that end with a user turn (what ``flashtree export-prompts`` writes, first turns or
every turn with its history) as they are, else the chats' first user turns (or every user turn:
``--turns all``), many at once (``max_running`` slots, continuous batching), greedy or
sampled (``samples`` answers a prompt, ids ``<id>``, ``<id>~s1``, ...; each answer's seed comes
from its id, so a resumed run samples what one run would have). Each finished answer is written
at once as ``{"id", "messages": [..., {"role": "assistant", "content"}], "train_from",
"finish_reason", "num_tokens"}`` plus the prompt's ``split`` and ``source`` when it has them
(``train_from``: the new answer's message index; training learns only from it); ids are the
source conversation ids, so the held-out split of the output equals the source's.

Output: a ``.jsonl`` file (``append``: add to it, skipping the ids it holds), or a directory of
shards ``part-00000.jsonl.gz``, ... (gzip by default) of at most ``shard_mb`` each: every run starts a new shard
(earlier shards are never rewritten, so a device call brings back only its own) and skips the
ids the directory already holds. ``max_minutes`` ends a run before a limit: no prompt is admitted
once the answers in flight might not finish, and at the limit the unfinished ones are dropped
(answered by the next run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from flashtree.errors import ConfigError
from flashtree.models.tokenizer import encode_chat
from flashtree.sampling import SamplingParams
from flashtree.train.data import (
    DEFAULT_HELDOUT_PERCENT,
    TURN_CHOICES,
    Conversation,
    chat_prompts,
    iter_jsonl,
    load_conversations,
    shard_files,
    split_conversations,
)
from flashtree.train.shard_writer import SHARD_SUFFIXES, ShardWriter

SAMPLE_SUFFIX = "~s{k}"
DRAIN_SAFETY = 1.5  # the answers in flight get this many times their measured worst-case time


class PromptItem(NamedTuple):
    prompt_id: str
    messages: list[dict]  # ending with the user turn to answer
    split: str | None = None
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    prompts: str = "sharegpt"  # sharegpt | prompts/chats .jsonl
    output: str = "regenerated.jsonl"
    split: str = "train"  # train | heldout | all (by conversation, as training splits)
    limit: int | None = None  # prompts to answer
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0
    heldout_percent: float = DEFAULT_HELDOUT_PERCENT
    time_budget_s: float | None = None  # stop admitting prompts after this much time; finish the rest
    turns: str = "first"  # chats (not prompt records): first user turn, or every user turn ("all")
    append: bool = False  # add to an existing .jsonl output, skipping the ids it holds (a directory always does)
    samples: int = 1  # answers per prompt (sampled: temperature > 0)
    shard_mb: float = 15.0  # directory output: a new shard past this size (on disk)
    shard_compression: str = "gzip"  # directory output: gzip (part-NNNNN.jsonl.gz) or none (part-NNNNN.jsonl)
    max_minutes: float | None = None  # end the run before this many minutes (in-flight answers dropped)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.split not in ("train", "heldout", "all"):
            raise ConfigError(f"--split {self.split!r}; allowed: train, heldout, all")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"--time-budget-s must be > 0, got {self.time_budget_s}")
        if self.turns not in TURN_CHOICES:
            raise ConfigError(f"--turns {self.turns!r}; allowed: {', '.join(TURN_CHOICES)}")
        if self.samples < 1:
            raise ConfigError(f"--samples must be >= 1, got {self.samples}")
        if self.samples > 1 and self.temperature == 0:
            raise ConfigError(f"--samples {self.samples} needs --temperature > 0 (greedy answers are all the same)")
        if self.shard_compression not in SHARD_SUFFIXES:
            raise ConfigError(f"--shard-compression {self.shard_compression!r}; allowed: {', '.join(SHARD_SUFFIXES)}")
        if not self.shard_mb > 0:
            raise ConfigError(f"--shard-mb must be > 0, got {self.shard_mb}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"--max-minutes must be > 0, got {self.max_minutes}")

    @property
    def sharded(self) -> bool:
        """A directory of shards (anything but a ``.jsonl`` path)."""
        return not self.output.endswith(".jsonl")


@dataclasses.dataclass
class RegenerateStats:
    answered: int = 0
    skipped: int = 0  # prompts too long for the context
    dropped: int = 0  # in flight at the --max-minutes limit: not written, answered next run
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def select_prompts(cfg: RegenerateConfig) -> list[PromptItem]:
    """The prompts to answer (one item per answer to write), without those already answered."""
    convs = load_conversations(cfg.prompts)
    if cfg.split != "all":
        train, heldout = split_conversations(convs, cfg.heldout_percent)
        convs = train if cfg.split == "train" else heldout
    if convs and all(_is_prompt_record(c) for c in convs):  # an exported prompts file: as it is
        prompts = [PromptItem(c.conv_id, [dict(m) for m in c.messages], c.split, c.source) for c in convs]
    else:
        prompts = [PromptItem(pid, messages) for pid, messages in chat_prompts(convs, turns=cfg.turns)]
    prompts = [item._replace(prompt_id=sample_id(item.prompt_id, k)) for item in prompts for k in range(cfg.samples)]
    if cfg.append or cfg.sharded:
        done = answered_ids(cfg.output)
        prompts = [item for item in prompts if item.prompt_id not in done]
    return prompts[:cfg.limit] if cfg.limit is not None else prompts


def sample_id(prompt_id: str, k: int) -> str:
    """The id of the ``k``-th answer to a prompt (the first keeps the prompt's id)."""
    return prompt_id if k == 0 else prompt_id + SAMPLE_SUFFIX.format(k=k)


def answer_seed(seed: int, answer_id: str) -> int:
    """A sampling seed from the answer's id: the same answer whatever ran before it."""
    return (seed * 1_000_003 + int.from_bytes(hashlib.sha256(answer_id.encode()).digest()[:4], "big")) % 2**31


def _is_prompt_record(conv: Conversation) -> bool:
    return bool(conv.messages) and conv.messages[-1]["role"] == "user"


def answered_ids(path: str | Path) -> set[str]:
    """Ids already in a regenerate output, a file or a shard directory (none when it does not exist)."""
    path = Path(path)
    files = shard_files(path) if path.is_dir() else [path] if path.is_file() else []
    return {record["id"] for file in files for _, record in iter_jsonl(file)}


class _Drain:
    """When to stop admitting prompts: a prompt admitted now may need ``max_new_tokens`` engine
    steps; that many steps of the mean time so far must fit before the end."""

    def __init__(self, ends_at: float | None, max_new_tokens: int):
        self.ends_at, self.max_new_tokens = ends_at, max_new_tokens
        self.steps, self.step_seconds = 0, 0.0

    def step_took(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds

    def admit(self, now: float) -> bool:
        mean = self.step_seconds / self.steps if self.steps else 0.0
        return self.ends_at is None or now + DRAIN_SAFETY * mean * self.max_new_tokens < self.ends_at

    def over(self, now: float) -> bool:
        return self.ends_at is not None and now >= self.ends_at


def _output(cfg: RegenerateConfig):
    if cfg.sharded:
        return ShardWriter(cfg.output, int(cfg.shard_mb * 1024 * 1024), cfg.shard_compression)
    out_path = Path(cfg.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return out_path.open("a" if cfg.append else "w", encoding="utf-8")


def regenerate(llm, prompts: Sequence[PromptItem], cfg: RegenerateConfig, started_at: float | None = None
               ) -> RegenerateStats:
    """Answer every prompt with ``llm`` (a :class:`flashtree.LLM`) and write JSONL to ``cfg.output``.
    ``started_at``: the ``time.perf_counter()`` reading ``max_minutes`` counts from (default: now)."""
    engine = llm.engine
    stats = RegenerateStats()
    limit = engine.config.cache.max_context - cfg.max_new_tokens
    pending = []
    for item in map(PromptItem._make, prompts):
        ids = encode_chat(llm.tokenizer, item.messages)
        if len(ids) > max(1, limit):
            stats.skipped += 1
            continue
        pending.append((item, ids))
    pending.reverse()  # pop() from the end keeps source order
    start = time.perf_counter()
    ends_at = (started_at or start) + cfg.max_minutes * 60 if cfg.max_minutes is not None else None
    drain = _Drain(ends_at, cfg.max_new_tokens)
    bar = _progress(len(pending), cfg.progress)
    in_flight: dict[str, PromptItem] = {}
    queue_size = min(engine.config.scheduler.max_running, engine.config.scheduler.max_waiting)  # keep every slot busy
    with contextlib.closing(_output(cfg)) as handle:
        while pending or in_flight:
            now = time.perf_counter()
            if drain.over(now):
                for request_id in in_flight:
                    engine.abort(request_id)
                stats.dropped += len(in_flight)
                break
            admit = (cfg.time_budget_s is None or now - start < cfg.time_budget_s) and drain.admit(now)
            while admit and pending and len(engine.scheduler.waiting) < queue_size:
                item, ids = pending.pop()
                params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                                        seed=answer_seed(cfg.seed, item.prompt_id))
                in_flight[engine.add_request(ids, params).request_id] = item
            if not admit:
                pending.clear()
            events = engine.step()
            drain.step_took(time.perf_counter() - now)
            for event in events:
                if event.finished and event.request.request_id in in_flight:
                    req = event.request
                    _write(handle, in_flight.pop(req.request_id), req)
                    stats.answered += 1
                    stats.tokens += len(req.output_ids)
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{stats.tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    stats.seconds = time.perf_counter() - start
    return stats


def _write(handle, item: PromptItem, req) -> None:
    record = {"id": item.prompt_id, "messages": [*item.messages, {"role": "assistant", "content": req.text}],
              "train_from": len(item.messages),  # earlier assistant turns (history) are not the target's
              "finish_reason": req.finish_reason, "num_tokens": len(req.output_ids)}
    record.update({k: v for k, v in (("split", item.split), ("source", item.source)) if v is not None})
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="regenerate", unit="chat", disable=not enabled, dynamic_ncols=True)
