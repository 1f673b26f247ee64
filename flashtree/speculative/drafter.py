"""The DFlash drafter at inference: its context cache, the features it defers, and their catch-up.

DFlash and DDTree share one :class:`DrafterRunner` (the drafter and its own context KV cache) through
:class:`DrafterProposer`; they differ only in what they make of the draft logits (``dflash.py``,
``ddtree.py``).

Glossary
- b: the drafter's block size; b-1 = max_depth, the draft horizon.
- context length: committed tokens of a slot whose context K/V the drafter holds; after every
  drafted round it equals the target's committed length.
- lag: after plain rounds (0 nodes) the drafter does not project the committed tokens' context
  features at once. It keeps them (``defer``, or in a plain round ``feature_sink``: the target's
  fused norm writes them in place; up to the lag capacity per slot, :func:`lag_capacity`) and
  projects them all in one pass (``catch_up_rows``) before the slot's next drafted round, or when
  the lag is full. An engine that settles on plain rounds (a drafter that rarely matches) then pays
  one batched projection per capacity's worth of tokens instead of a drafter pass per token, and a
  short request none at all unless a drafted round comes. A prompt short enough
  to fit the lag is deferred the same way at prefill, so the first token does not wait for the
  drafter. :class:`DrafterLag` is the one place that counts each request's lag and decides when it is
  caught up; the device keeps no count.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from flashtree.device_copy import to_device
from flashtree.kernels.feature_sink import FeatureSink
from flashtree.kv.cache import KVCache
from flashtree.kv.pages import PageTable
from flashtree.models.dflash import DFlashDrafter
from flashtree.speculative.proposer import DraftCandidates, RoundRows
from flashtree.speculative.tree.draft_tree import ROOT, DraftTree

LAG_CAPACITY = 64  # committed tokens a slot's drafter context may lag behind (see "lag"), on a GPU
CPU_LAG_CAPACITY = 256  # the same on a CPU, where the lag buffer's memory allows it (CPU_LAG_BYTES)
CPU_LAG_BYTES = 32 * 2 ** 20  # at most this much lag buffer for the longer CPU capacity


def lag_capacity(device: torch.device, slots: int, feature_bytes: int) -> int:
    """The lag capacity for ``slots`` slots of ``feature_bytes`` context features per token. A GPU
    keeps LAG_CAPACITY (its catch-up's CUDA graph runs the full width, so wider costs every catch-up);
    a CPU's catch-up runs the lags it has, so a longer capacity only defers more: up to
    CPU_LAG_CAPACITY while the buffer stays within CPU_LAG_BYTES (a request of a few hundred tokens on
    plain rounds then never projects its context at all)."""
    if device.type != "cpu":
        return LAG_CAPACITY
    fits = CPU_LAG_BYTES // (slots * feature_bytes) - 1  # (- the padding column)
    return max(LAG_CAPACITY, min(CPU_LAG_CAPACITY, fits))


class LaggingRow(Protocol):
    """What :class:`DrafterLag` reads and writes of a request."""

    prompt_ids: list[int]
    prefilled: int  # prompt tokens already in the cache
    drafter_lag: int  # committed tokens whose context features the drafter has deferred (only DrafterLag writes it)


class DrafterLag:
    """How many committed tokens each request's drafter context lags behind, and when it catches up:
    the one place that reads and writes ``drafter_lag``.

    ``capacity`` 0 (plain decoding): nothing is ever deferred and every method is a no-op."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def of(self, row: LaggingRow) -> int:
        return row.drafter_lag

    def prompts_to_defer(self, rows: Sequence[LaggingRow], chunk: int) -> list[bool]:
        """Per row of a prefill: its whole prompt is in this chunk and fits the lag (the drafter then
        defers the prompt's features, and the first token does not wait for the drafter)."""
        return [self.capacity > 0 and r.prefilled == 0 and len(r.prompt_ids) <= min(self.capacity, chunk)
                for r in rows]

    def prompts_deferred(self, rows: Sequence[LaggingRow], deferred: Sequence[bool]) -> None:
        """The prefill deferred the whole prompt of the rows ``deferred`` marks."""
        for row, was in zip(rows, deferred):
            if was:
                row.drafter_lag = len(row.prompt_ids)

    def due(self, rows: Sequence[LaggingRow], nodes: int) -> list[LaggingRow]:
        """The rows to catch up before a round of ``nodes`` nodes: before a drafted round, or when
        some row's lag is full, every lagging row (so rows fall into step and one pass serves them
        all every ``capacity`` rounds)."""
        if not self.capacity or not (nodes > 0 or any(r.drafter_lag >= self.capacity for r in rows)):
            return []
        return [r for r in rows if r.drafter_lag]

    def full_after_plain(self, rows: Sequence[LaggingRow]) -> bool:
        """After one more plain round some row's lag is full (a round queued behind it catches up first)."""
        return self.capacity > 0 and any(r.drafter_lag + 1 >= self.capacity for r in rows)

    def caught_up(self, rows: Sequence[LaggingRow]) -> None:
        for row in rows:
            row.drafter_lag = 0

    def after_round(self, rows: Sequence[LaggingRow], nodes: int) -> None:
        """A plain round deferred each row's committed token."""
        if self.capacity and nodes == 0:
            for row in rows:
                row.drafter_lag += 1


class DrafterRunner:
    """The drafter, its context cache and deferred features, and the things a round does with them."""

    def __init__(self, drafter: DFlashDrafter, max_slots: int, max_context: int, prefill_chunk: int):
        """A runner for ``max_slots`` slots of ``max_context`` tokens. Its context cache (scratch for a
        prefill chunk and a catch-up, which pads to the largest lag) is made by :meth:`attach_pages`."""
        self.drafter = drafter
        self.max_slots, self.max_context = max_slots, max_context
        slots, width = max_slots, drafter.fc.in_features
        weight = drafter.fc.weight
        capacity = lag_capacity(weight.device, slots, width * weight.element_size())
        self.scratch = max(prefill_chunk, capacity)
        self.cache: KVCache | None = None
        self.lag = DrafterLag(capacity)
        # [S, W + 1, F]: W = capacity deferred tokens per slot, then a column that takes the writes of
        # padding (positions past a row's count, pad rows).
        self.lagging = torch.zeros(slots, capacity + 1, width, dtype=weight.dtype, device=weight.device)
        self.vocab_ids: torch.Tensor | None = None  # [N] token ids of the draft indices (draft_vocab.py), or None

    def attach_pages(self, pages: PageTable | None) -> None:
        """Make the context cache on ``pages`` (the engine's block tables), or on a table of its own
        with every slot fully mapped (None)."""
        self.cache = self.drafter.new_cache(self.max_slots, self.max_context, self.scratch, pages)

    def restrict_vocab(self, head, token_ids: torch.Tensor) -> None:
        """Draft from ``token_ids`` only (a draft vocabulary, ``draft_vocab.py``): ``head`` gives
        the drafter's logits over their draft indices."""
        self.drafter.target = self.drafter.target._replace(head=head, draft_head=head)
        self.vocab_ids = token_ids.to(self.lagging.device)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of draft indices (``>= 0``; the identity without a draft vocabulary)."""
        return indices if self.vocab_ids is None else self.vocab_ids[indices]

    def tree_token_ids(self, tree: DraftTree) -> DraftTree:
        """``tree`` with its drafted nodes' draft indices turned into token ids (the root's filler
        and the invalid nodes' padding stay)."""
        if self.vocab_ids is None:
            return tree
        drafted = tree.valid & (torch.arange(tree.tokens.shape[1], device=tree.tokens.device) != ROOT)  # [B, N]
        return tree._replace(tokens=torch.where(drafted, self.vocab_ids[tree.tokens.clamp(min=0)], tree.tokens))

    def candidates(self, logits: torch.Tensor, k: int) -> DraftCandidates:
        """The ``k`` likeliest tokens per depth of draft logits ``[B, L, V]`` (target ids), best first."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)  # [B, L, K] x2
        return DraftCandidates(top.values, self.token_ids(top.indices))

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        """Keep the context features ``[B, P, F]`` of each row's ``counts[b]`` newly committed
        tokens (default: all P; a plain round has P = 1) for a later catch-up, after the
        ``lags[b]`` tokens the row has deferred already (``[B]``; the lag capacity for a pad row: its
        writes go to the padding column). Capturable; the host keeps every real row's lag within
        the capacity."""
        width, capacity = features.shape[1], self.lag.capacity
        if counts is None and width == 1:  # a plain round (inside its CUDA graph): one small op
            self.lagging[slots, lags] = features[:, 0].to(self.lagging.dtype)
            return
        j = torch.arange(width, device=slots.device)  # [P]
        counts = torch.full_like(slots, width) if counts is None else counts  # [B]
        at = lags[:, None] + j  # [B, P]
        at = torch.where((j < counts[:, None]) & (at < capacity), at, capacity)  # [B, P]
        self.lagging[slots[:, None], at] = features.to(self.lagging.dtype)

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink:
        """Where a plain round's target forward writes its one new token's features per row: the
        place :meth:`defer` would put them (``slots``, ``lags`` ``[B]`` as there). Capturable."""
        columns = self.lag.capacity + 1
        return FeatureSink(self.lagging.view(-1, self.lagging.shape[-1]), slots * columns + lags)  # rows [B]

    def catch_up(self, slots: Sequence[int], starts: Sequence[int], lags: Sequence[int]) -> None:
        """Project the ``lags[i]`` deferred features of each of ``slots`` into the drafter's
        context, which holds ``starts[i]`` tokens of it so far (the committed length minus the
        lag), in one pass."""
        width = max(lags, default=0)
        if width:
            rows = torch.tensor([list(slots), list(starts), list(lags)], dtype=torch.long, device=self.lagging.device)
            self.catch_up_rows(*rows.unbind(0), width)  # [B] each

    def catch_up_rows(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        """:meth:`catch_up` on the device (capturable): ``slots [B]``, their context lengths ``starts
        [B]``, their deferred tokens ``counts [B]`` (0 for a graphed catch-up's pad rows: they project
        nothing), ``width`` at least the largest count. All from the host, so running it twice (a
        CUDA-graph capture's warm-up, then the replay) leaves what running it once does."""
        self.drafter.observe(self.cache, slots, self.lagging[slots, :width], counts, starts)

    def observe(self, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        """Context features ``[B, P, F]`` of tokens committed at ``starts[b] + j``, j < counts[b]."""
        self.drafter.observe(self.cache, slots, features, counts, starts)

    def draft_logits(self, rows: RoundRows, depth: int | None = None) -> torch.Tensor:
        """``[B, depth, V]`` draft logits (default depth b-1) for every row's block; rows may have
        different lengths."""
        return self.drafter.draft_logits(self.cache, rows.slots, rows.bonus, rows.starts,
                                         kv_len=self._attention_extent(rows), depth=depth)

    def _attention_extent(self, rows: RoundRows) -> int:
        """Keys attended per row in the block pass.

        Eager: one small host sync for the longest context (it waits only for the round's own
        inputs) gives a tight key range. Under CUDA-graph capture nothing may sync and the graph
        must fit every replay: attend over the whole cache capacity.
        """
        if (self.drafter.uses_kernel_attention(self.drafter.config.block_size)
                or (rows.slots.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self.cache.spec.capacity  # (the kernel attention reads lengths itself)
        return int(rows.starts.max()) + self.drafter.config.block_size

    def release(self, slots: Sequence[int]) -> None:
        if len(slots):
            self.cache.free(to_device(torch.tensor(list(slots), dtype=torch.long), self.cache.lengths.device))


class DrafterProposer:
    """What DFlash and DDTree share: the capture layers, the depth, and every drafter call."""

    name = ""
    chain = False
    tree_kernel = False

    def __init__(self, runner: DrafterRunner, max_nodes: int):
        config = runner.drafter.config
        self.runner = runner
        self.lag = runner.lag
        self.capture_layers: tuple[int, ...] = tuple(config.target_layer_ids)
        self.max_depth = config.block_size - 1
        self.max_nodes = max_nodes

    def observe(self, slots, features, counts, starts) -> None:
        self.runner.observe(slots, features, counts, starts)

    def defer(self, slots: torch.Tensor, features: torch.Tensor, lags: torch.Tensor,
              counts: torch.Tensor | None = None) -> None:
        self.runner.defer(slots, features, lags, counts)

    def feature_sink(self, slots: torch.Tensor, lags: torch.Tensor) -> FeatureSink:
        return self.runner.feature_sink(slots, lags)

    def catch_up_rows(self, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> None:
        self.runner.catch_up_rows(slots, starts, counts, width)

    def release(self, slots: Sequence[int]) -> None:
        self.runner.release(slots)

    def attach_pages(self, pages: PageTable) -> None:
        self.runner.attach_pages(pages)

    def context_entry_bytes(self) -> int:
        config, weight = self.runner.drafter.config, self.runner.drafter.fc.weight
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * weight.element_size()
