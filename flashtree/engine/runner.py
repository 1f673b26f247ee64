"""ModelRunner: the target model, its KV cache and the two things a step does with them.

- ``prefill``: run a chunk of each row's prompt, commit it, hand the context features to the
  proposer, and choose the first output token for rows whose prompt is complete.
- ``round``: draft (proposer) -> verify the tree with one target pass -> choose the target's
  token at every node -> accept walk -> commit the accepted path's KV and features.

Both end with exactly one host sync: the tokens the scheduler needs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import NamedTuple, Sequence

import torch

from flashtree.engine.request import Request
from flashtree.kv_cache import KVCache
from flashtree.models.batch import ForwardBatch, causal_mask, slot_range_of
from flashtree.models.transformer import CausalLM
from flashtree.sampling import SamplingTensors, choose_tokens
from flashtree.spec.proposer import Proposer
from flashtree.spec.verify import accept_walk


class RoundRows(NamedTuple):
    slots: torch.Tensor  # [B]
    bonus: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]
    budgets: torch.Tensor  # [B]


class RoundResult(NamedTuple):
    emitted: list[list[int]]  # per row: accepted drafts + next bonus (= acceptance length tokens)
    tree_sizes: list[int]  # per row: drafted nodes verified


class StageTimer:
    """Wall time per stage; synchronizes the device around stages only when ``sync``."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    def mark(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, stage: str, since: float) -> float:
        now = self.mark()
        self.seconds[stage] += now - since
        return now


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, proposer: Proposer, timer: StageTimer):
        self.model, self.cache, self.proposer, self.timer = model, cache, proposer, timer
        self.device = model.lm_head.weight.device

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, rows: Sequence[Request], chunk: int) -> list[int | None]:
        """Run the next prompt chunk of every row; returns the first output token of rows whose
        prompt completed (None for rows still prefilling)."""
        t0 = self.timer.mark()
        pieces = [r.prompt_ids[r.prefilled:r.prefilled + chunk] for r in rows]
        width = max(len(p) for p in pieces)
        counts = self._tensor([len(p) for p in pieces])  # [B]
        starts = self._tensor([r.prefilled for r in rows])  # [B]
        ids = self._tensor([p + [0] * (width - len(p)) for p in pieces])  # [B, W]
        slots_list = [r.slot for r in rows]
        slots = self._tensor(slots_list)
        batch = ForwardBatch(
            input_ids=ids, positions=starts[:, None] + torch.arange(width, device=self.device),
            slots=slots, cache_lengths=starts, new_mask=causal_mask(counts, width),
            kv_len=max(r.prefilled for r in rows) + width, slot_range=slot_range_of(slots_list))
        last = (counts - 1)[:, None]  # [B, 1]
        out = self.model(batch, self.cache, logits_index=last, capture_layers=self.proposer.capture_layers)
        self.cache.advance(slots, counts)
        if out.hidden is not None:
            self.proposer.observe(slots, out.hidden, counts, starts)
        sampling = SamplingTensors.build([r.params for r in rows], self.device)
        first = choose_tokens(out.logits, sampling, torch.zeros_like(last))[:, 0].tolist()  # the one sync
        self.timer.add("prefill", t0)
        done = [r.prefilled + len(p) == len(r.prompt_ids) for r, p in zip(rows, pieces)]
        return [tok if d else None for tok, d in zip(first, done)]

    def round(self, rows: Sequence[Request]) -> RoundResult:
        t0 = self.timer.mark()
        slots_list = [r.slot for r in rows]
        round_rows = RoundRows(
            slots=self._tensor(slots_list), bonus=self._tensor([r.output_ids[-1] for r in rows]),
            starts=self._tensor([r.committed_length for r in rows]),
            budgets=self._tensor([self.proposer.max_nodes if r.budget is None else min(r.budget, self.proposer.max_nodes)
                                  for r in rows]))
        tree = self.proposer.propose(round_rows)
        tokens = torch.cat([round_rows.bonus[:, None], tree.tokens[:, 1:].clamp(min=0)], dim=1)  # [B, T+1]
        t1 = self.timer.add("draft", t0)

        n_nodes = tokens.shape[1]
        batch = ForwardBatch(
            input_ids=tokens, positions=round_rows.starts[:, None] + tree.depths, slots=round_rows.slots,
            cache_lengths=round_rows.starts, new_mask=tree.ancestor_mask,
            kv_len=max(r.committed_length for r in rows) + n_nodes, slot_range=slot_range_of(slots_list))
        out = self.model(batch, self.cache, capture_layers=self.proposer.capture_layers)
        sampling = SamplingTensors.build([r.params for r in rows], self.device)
        generated = self._tensor([len(r.output_ids) for r in rows])  # [B] next output index
        choice = choose_tokens(out.logits, sampling, generated[:, None] + tree.depths)  # [B, T+1]
        t2 = self.timer.add("verify", t1)

        walk = accept_walk(tree._replace(tokens=tokens), choice, self.proposer.max_depth)
        path = walk.path.clamp(min=0)  # [B, D+1]
        self.cache.commit(round_rows.slots, path, walk.accept_lengths)
        if out.hidden is not None:
            features = out.hidden.gather(1, path[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
            self.proposer.observe(round_rows.slots, features, walk.accept_lengths, round_rows.starts)
        host = self._to_host(walk, tree.valid)  # the one sync
        self.timer.add("commit", t2)
        return host

    @staticmethod
    def _to_host(walk, valid: torch.Tensor) -> RoundResult:
        """Emitted tokens per row: the accepted drafts (committed path minus the old bonus) and
        then the next bonus; their number is the acceptance length."""
        counts = walk.accept_lengths  # [B]
        pad = torch.full_like(walk.next_bonus[:, None], -1)
        emitted = torch.cat([walk.committed_tokens[:, 1:], pad], dim=1)  # [B, D+1]
        emitted = emitted.scatter(1, (counts - 1)[:, None], walk.next_bonus[:, None])
        sizes = valid.sum(1, keepdim=True) - 1  # [B, 1] drafted nodes
        host = torch.cat([counts[:, None], sizes, emitted], dim=1).tolist()
        return RoundResult(emitted=[row[2:2 + row[0]] for row in host], tree_sizes=[row[1] for row in host])
