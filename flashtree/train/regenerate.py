"""``flashtree regenerate``: answer prompts with the TARGET itself and write the chats as JSONL.

A drafter imitates its target best when trained on the target's own answers (the published
DFlash drafters were trained this way). Prompts go through our engine: the records of a
prompts file that end with a user turn (what ``flashtree export-prompts`` writes, first turns or
every turn with its history) as they are, else the chats' first user turns (or every user turn:
``--turns all``), many at once (``max_running`` slots, continuous batching), greedy or
sampled. Each finished answer is written at once as
``{"id", "messages": [..., {"role": "assistant", "content"}], "train_from", "finish_reason", "num_tokens"}``
(``train_from``: the new answer's message index; training learns only from it);
ids are the source conversation ids, so the held-out split of the output equals the source's.
``--append`` adds to an existing output and skips the ids it already holds, so a large set can
be answered over several runs (e.g. device calls of limited length).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

from flashtree.errors import ConfigError
from flashtree.models.tokenizer import encode_chat
from flashtree.sampling import SamplingParams
from flashtree.train.data import (
    DEFAULT_HELDOUT_PERCENT,
    TURN_CHOICES,
    Conversation,
    chat_prompts,
    load_conversations,
    split_conversations,
)


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
    append: bool = False  # add to an existing output, skipping the ids it already holds
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


@dataclasses.dataclass
class RegenerateStats:
    answered: int = 0
    skipped: int = 0  # prompts too long for the context
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def select_prompts(cfg: RegenerateConfig) -> list[tuple[str, list[dict]]]:
    """(id, messages ending with the user turn to answer) of the prompts to answer."""
    convs = load_conversations(cfg.prompts)
    if cfg.split != "all":
        train, heldout = split_conversations(convs, cfg.heldout_percent)
        convs = train if cfg.split == "train" else heldout
    if convs and all(_is_prompt_record(c) for c in convs):  # an exported prompts file: as it is
        prompts = [(c.conv_id, [dict(m) for m in c.messages]) for c in convs]
    else:
        prompts = chat_prompts(convs, turns=cfg.turns)
    if cfg.append:
        done = answered_ids(cfg.output)
        prompts = [(pid, messages) for pid, messages in prompts if pid not in done]
    return prompts[:cfg.limit] if cfg.limit is not None else prompts


def _is_prompt_record(conv: Conversation) -> bool:
    return bool(conv.messages) and conv.messages[-1]["role"] == "user"


def answered_ids(path: str | Path) -> set[str]:
    """Ids already in a regenerate output (none when it does not exist yet)."""
    path = Path(path)
    if not path.is_file():
        return set()
    with path.open(encoding="utf-8") as handle:
        return {json.loads(line)["id"] for line in handle if line.strip()}


def regenerate(llm, prompts: Sequence[tuple[str, list[dict]]], cfg: RegenerateConfig) -> RegenerateStats:
    """Answer every prompt with ``llm`` (a :class:`flashtree.LLM`) and append JSONL to ``cfg.output``."""
    engine = llm.engine
    stats = RegenerateStats()
    out_path = Path(cfg.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    limit = engine.config.cache.max_context - cfg.max_new_tokens
    pending = []
    for index, (conv_id, messages) in enumerate(prompts):
        ids = encode_chat(llm.tokenizer, messages)
        if len(ids) > max(1, limit):
            stats.skipped += 1
            continue
        pending.append((index, conv_id, messages, ids))
    pending.reverse()  # pop() from the end keeps source order
    start = time.perf_counter()
    bar = _progress(len(pending), cfg.progress)
    in_flight: dict[str, tuple[str, list[dict]]] = {}
    queue_size = min(engine.config.scheduler.max_running, engine.config.scheduler.max_waiting)  # keep every slot busy
    with out_path.open("a" if cfg.append else "w", encoding="utf-8") as handle:
        while pending or in_flight:
            admit = cfg.time_budget_s is None or time.perf_counter() - start < cfg.time_budget_s
            while admit and pending and len(engine.scheduler.waiting) < queue_size:
                index, conv_id, messages, ids = pending.pop()
                params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                        max_tokens=cfg.max_new_tokens, seed=cfg.seed + index)
                in_flight[engine.add_request(ids, params).request_id] = (conv_id, messages)
            if not admit:
                pending.clear()
            for event in engine.step():
                if event.finished and event.request.request_id in in_flight:
                    req = event.request
                    conv_id, messages = in_flight.pop(req.request_id)
                    _write(handle, conv_id, messages, req)
                    stats.answered += 1
                    stats.tokens += len(req.output_ids)
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{stats.tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    stats.seconds = time.perf_counter() - start
    return stats


def _write(handle, conv_id: str, messages: list[dict], req) -> None:
    record = {"id": conv_id, "messages": [*messages, {"role": "assistant", "content": req.text}],
              "train_from": len(messages),  # earlier assistant turns (history) are not the target's
              "finish_reason": req.finish_reason, "num_tokens": len(req.output_ids)}
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="regenerate", unit="chat", disable=not enabled, dynamic_ncols=True)
