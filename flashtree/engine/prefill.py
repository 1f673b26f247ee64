"""Prefill: the next chunk of each admitted request's prompt through the target, committed to its cache.

Each row's chunk is padded to the widest one and runs causally after the prompt tokens already in
its slot. The chunk's context features go to the proposer (projected at once, or deferred when the
whole prompt fits the drafter's lag: ``speculative/drafter.py``), and rows whose prompt is now
complete get their first output token, chosen like every later one (``flashtree/sampling.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from flashtree.engine.constraint import GrammarRound
from flashtree.engine.request import Request
from flashtree.engine.stage_timer import StageTimer
from flashtree.engine.token_state import SlotTokenState
from flashtree.kv.cache import KVCache
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.transformer import CausalLM
from flashtree.penalties import adjust_logits
from flashtree.sampling import (
    MAX_LOGPROBS,
    SamplingTensors,
    TokenLogprob,
    choose_tokens,
    logprob_records,
    token_logprobs,
)
from flashtree.speculative.proposer import Proposer


class FirstToken(NamedTuple):
    """A request's first output token, chosen when its prompt completes."""

    token: int
    logprob: TokenLogprob | None  # when the request asked for log-probabilities


class Prefill:
    def __init__(self, model: CausalLM, cache: KVCache, proposer: Proposer, timer: StageTimer,
                 planless: bool = True):
        """``planless``: CUDA attention with kernels that build no per-shape plan (a prefill's shape
        seldom recurs; ``models/attention.py``)."""
        self.model, self.cache, self.proposer, self.timer = model, cache, proposer, timer
        self.device = model.lm_head.weight.device
        self.planless = planless
        self.token_state: SlotTokenState | None = None  # the engine's, once a request adjusts its logits

    def __call__(self, rows: Sequence[Request], chunk: int, defer: Sequence[bool] | None = None
                 ) -> list[FirstToken | None]:
        """Run the next prompt chunk of every row; returns the first output token of rows whose
        prompt completed (None for rows still prefilling). ``defer[i]``: the proposer keeps row
        i's context features for a later catch-up instead of projecting them now."""
        t0 = self.timer.mark()
        pieces = [r.prompt_ids[r.prefilled:r.prefilled + chunk] for r in rows]
        width = max(len(p) for p in pieces)
        counts = self._tensor([len(p) for p in pieces])  # [B]
        starts = self._tensor([r.prefilled for r in rows])  # [B]
        ids = self._tensor([p + [0] * (width - len(p)) for p in pieces])  # [B, W]
        slots_list = [r.slot for r in rows]
        self.cache.pages.ensure(slots_list, [r.prefilled + len(p) for r, p in zip(rows, pieces)])
        slots = self._tensor(slots_list)
        batch = ForwardBatch(
            input_ids=ids, positions=starts[:, None] + torch.arange(width, device=self.device),
            slots=slots, cache_lengths=starts, new_mask=causal_mask(counts, width),
            kv_len=max(r.prefilled for r in rows) + width,
            one_off_shape=self.planless, prefill=True)
        last = (counts - 1)[:, None]  # [B, 1]
        out = self.model(batch, self.cache, logits_index=last, capture_layers=self.proposer.capture_layers)
        self.cache.advance(slots, counts)
        if out.hidden is not None:
            self._hand_features(rows, slots, out.hidden, counts, starts, defer)
        sampling = SamplingTensors.build([r.params for r in rows], self.device)
        logits = out.logits
        adjust = any(r.params.adjusts for r in rows)
        if adjust:
            logits = adjust_logits(logits, torch.zeros_like(last), self.token_state.gather(slots, torch.zeros_like(slots)))
        if GrammarRound.needed(rows):  # a first token the grammar allows
            grammar = GrammarRound(rows, len(rows), logits.shape[-1], self.device)
            logits = logits.masked_fill(~grammar.allowed, float("-inf"))
        chosen = choose_tokens(logits, sampling, torch.zeros_like(last))  # [B, 1]
        done = [r.prefilled + len(p) == len(r.prompt_ids) for r, p in zip(rows, pieces)]
        if adjust:  # the first output token of the rows whose prompt completed
            self.token_state.record(slots, chosen, self._tensor([int(d) for d in done]), torch.zeros_like(slots))
        first = chosen[:, 0].tolist()  # the one sync
        logprobs = self._logprobs(rows, out.logits, chosen, first)
        self.timer.add("prefill", t0)
        return [FirstToken(tok, lp) if d else None for tok, lp, d in zip(first, logprobs, done)]

    @staticmethod
    def _logprobs(rows: Sequence[Request], logits: torch.Tensor, chosen: torch.Tensor, first: list[int]
                  ) -> list[TokenLogprob | None]:
        """The first tokens' log-probabilities for the rows that asked (logits ``[B, 1, V]``)."""
        ks = [r.params.logprobs for r in rows]
        if all(k is None for k in ks):
            return [None] * len(rows)
        values = token_logprobs(logits, chosen, MAX_LOGPROBS)
        records = logprob_records(values, [[tok] for tok in first], ks)
        return [None if r is None else r[0] for r in records]

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _hand_features(self, rows: Sequence[Request], slots: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor,
                       starts: torch.Tensor, defer: Sequence[bool] | None) -> None:
        """A prefill chunk's context features ``[B, W, F]`` to the proposer: deferred for the rows
        ``defer`` marks (after their lag so far), projected now for the others (each call sees the
        other rows' counts as 0)."""
        if not defer or not any(defer):
            self.proposer.observe(slots, hidden, counts, starts)
            return
        lags = self._tensor([self.proposer.lag.of(r) for r in rows])  # [B]
        deferred = self._tensor([int(d) for d in defer])  # [B] 1: deferred
        self.proposer.defer(slots, hidden, lags, counts * deferred)
        if not all(defer):
            self.proposer.observe(slots, hidden, counts * (1 - deferred), starts)
