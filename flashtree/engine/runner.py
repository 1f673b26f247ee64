"""ModelRunner: the host side of a decode round (inputs, CUDA graphs, the one read of its results).

``launch`` sends the rows' inputs to the device in two non-blocking copies and queues the round's
device work (``engine/round.py``), replayed as a CUDA graph when graphs are on (the engine
captures the graphs of its rounds at start-up, :meth:`ModelRunner.capture_graphs`; a round with no
graph then runs eagerly); ``finish`` waits for the round and reads its packed result, the host's one
sync per round. Between the two the host is free: the engine queues the next plain round there
(``engine/overlap.py``) and the policy folds its measurements.

Graphed rounds pad their rows to the next power of two with the pad slot (a KV slot no request
uses, with identical inputs in every pad row), so a handful of graphs serves every batch size. A
graph's key is (padded rows, :class:`~flashtree.engine.round.RoundShape`), whose key length is a
256-key bucket; with the Triton attention (the default in every decode forward), which reads lengths
and the block table itself, one graph serves every context length, so the key set is small and known
before serving.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from flashtree.config import KernelConfig
from flashtree.device_copy import to_device
from flashtree.engine.constraint import GrammarRound
from flashtree.engine.graphs import GraphCache
from flashtree.engine.request import Request
from flashtree.engine.round import (
    INT_FIELDS,
    DeviceRound,
    RoundInputs,
    RoundShape,
    RowAllotment,
    verifies_packed,
)
from flashtree.engine.stage_timer import StageTimer
from flashtree.engine.traces import RecentTrees, TreeTracer
from flashtree.kv.cache import KVCache
from flashtree.models.moe import routes_on_host
from flashtree.models.transformer import CausalLM
from flashtree.policy.base import round_fits
from flashtree.sampling import (
    MAX_LOGPROBS,
    TokenLogprob,
    TokenLogprobs,
    logprob_records,
    seed_value,
)
from flashtree.speculative.proposer import Proposer

KV_BUCKET = 256  # a graphed round's key length is rounded up to a multiple of this
# in the packed layout a round of n nodes per row verifies rows x (n + 1) tokens, each row's from a tree of up to
# this many times n nodes (its share of the total by its tree's path probabilities). On the shipped pair (16 rows,
# greedy, CPU) trees of 4n commit as many tokens as whole DDTree-32 trees at 1-8 nodes per row, 2n about 70% of
# that gain at 1-2 (benchmarks/row_budget_gain.py --spans); what the wider trees cost on a GPU is not measured yet
PACKED_TREE_SPAN = 4


def round_span(proposer: Proposer) -> int:
    """Positions past a row's committed context (as the host knows it) that a round may write: the
    tree's or the drafter block's entries, and one more for a plain round queued before the host
    has read the one ahead of it (``launch_plain_after``)."""
    return max(proposer.max_nodes, proposer.max_depth) + 2


class RoundResult(NamedTuple):
    emitted: list[list[int]]  # per row: accepted drafts + next bonus (= acceptance length tokens)
    tree_sizes: list[int]  # per row: drafted nodes verified
    captured_graph: bool = False  # this round captured a CUDA graph (its wall time is not typical)
    logprobs: list[list[TokenLogprob] | None] | None = None  # per row, per emitted token (rows that asked)


class LaunchedRound(NamedTuple):
    """A round whose device work is queued and whose results the host has not read yet."""

    rows: list[Request]  # the real rows, in the round's order (pad rows follow them on the device)
    nodes: int
    ints: torch.Tensor  # [8, B + pads] the RoundInputs' integer fields on the device (slots ... lags)
    floats: torch.Tensor  # [2, B + pads] temperature, top_p
    packed: torch.Tensor  # [B + pads, 2 + D + 1] see round.pack (a graph's static buffer)
    host: torch.Tensor  # packed, copied to (pinned) host memory once ``done``
    trace: tuple[torch.Tensor, ...] | None  # the round's tree tensors on the host, with a tree trace
    logprobs: TokenLogprobs | None  # the emitted tokens' log-probabilities on the host, when a row asked
    done: object  # a torch.cuda.Event recorded after those copies (None on a CPU: already done)
    captured_graph: bool  # launching it captured a CUDA graph
    launched_at: float  # perf_counter() when its device work was queued
    constrained: bool = False  # a row has a grammar: the round ran eagerly, with host work in it
    ragged: bool = False  # its verify forward ran the rows' tokens packed (cost by their total, not the widest row)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, proposer: Proposer, timer: StageTimer,
                 kernels: KernelConfig = KernelConfig(), tracer: TreeTracer | RecentTrees | None = None,
                 pad_slot: int | None = None, packed: bool = False):
        """``pad_slot``: a KV slot no request uses; graphed rounds pad their rows with it up to the
        next power of two (None: no padding). ``packed``: drafted tree rounds run in the packed layout
        (:meth:`_packed`), on any device; the engine turns it on with ``packed_verify=True`` on CUDA."""
        self.model, self.cache, self.proposer, self.timer = model, cache, proposer, timer
        self.packed = packed and not proposer.chain and proposer.max_nodes > 0
        self.device = model.lm_head.weight.device
        self.tracer = tracer
        # (a MoE target off the fused kernels reads its routing on the host: no graphs, models/moe.py)
        use_graphs = kernels.cuda_graphs and self.device.type == "cuda" and not timer.sync and not routes_on_host(model)
        self.graphs = GraphCache() if use_graphs else None
        self.pad_slot = pad_slot
        self.span = round_span(proposer)
        self.round_program = DeviceRound(model, cache, proposer, kernels, tracing=tracer is not None)
        # the host returns from queuing a round's device work before the device is done with it
        # (CUDA); on a CPU the work runs as it is queued
        self.runs_ahead = self.device.type == "cuda"
        self._plain_steps: dict[tuple[int, int], torch.Tensor] = {}  # see _plain_step

    # ------------------------------------------------------------------ rounds
    def round(self, rows: Sequence[Request], nodes: int | None = None, meanwhile: Callable[[], None] | None = None
              ) -> RoundResult:
        """One round of the running rows verifying ``nodes`` drafted nodes per row (default and at
        most ``proposer.max_nodes``; rows' own budgets cap theirs)."""
        return self.finish(self.launch(rows, nodes), meanwhile)

    def launch(self, rows: Sequence[Request], nodes: int | None = None, allotment: RowAllotment | None = None
               ) -> LaunchedRound:
        """Queue a round's device work; :meth:`finish` reads its results. ``allotment``: the rows'
        budgets come from their trees (eager rounds; a graph replays its rows' budgets as they are)."""
        nodes = self.proposer.max_nodes if nodes is None else nodes
        if not 0 <= nodes <= self.proposer.max_nodes:
            raise ValueError(f"nodes must be in [0, {self.proposer.max_nodes}], got {nodes}")
        self._map_pages(rows)
        pads = self._pad_rows(len(rows))
        shape = self._shape(rows, nodes)
        ints, floats = self._round_inputs(rows, shape.nodes, pads)  # (a packed round's rows may take its trees' size)
        grammar = None
        if GrammarRound.needed(rows):
            grammar = GrammarRound(rows, len(rows) + pads, self.model.config.vocab_size, self.device, nodes,
                                   self.proposer.chain, min(nodes, self.proposer.max_depth))
        return self._launch(list(rows), shape, len(rows) + pads, ints, floats, grammar, allotment, option=nodes)

    def launch_plain_after(self, previous: LaunchedRound, catch_up: bool = False) -> LaunchedRound | None:
        """Queue the plain round that follows the plain round ``previous`` for the same rows, before
        the host has read ``previous``: its inputs come from ``previous``'s on the device (the bonus
        token is the one ``previous`` chooses; position, output count and drafter lag one further
        for the real rows, the pad rows' unchanged). ``catch_up``: the drafter first projects every
        row's deferred features (its lag by then: one more than ``previous``'s), and the round starts
        from lag 0. The caller checked that every row has room for the token. None (nothing queued)
        when a CUDA graph it needs would be captured now: a capture waits for the device (a frozen
        cache runs a round with no graph eagerly, and that round is queued like any other)."""
        if previous.nodes != 0:
            raise ValueError("only a plain round's successor can be queued before its results are read")
        rows = previous.rows
        pads = self._pad_rows(len(rows))
        width = len(rows) + pads
        shape = self._shape(rows, 0, ahead=1)
        capacity = self.proposer.lag.capacity
        if self.graphs is not None and (self.graphs.would_capture((width, shape)) or (
                catch_up and self.graphs.would_capture(self._catch_up_key(width, capacity)))):
            return None
        self._map_pages(rows)
        step = self._plain_step(len(rows), pads)  # [8, B + pads]
        ints = previous.ints + step
        ints[1] = previous.packed[:, 2]  # the next bonus token
        if catch_up:
            real = step[2]  # [B + pads] 1 for a real row
            counts = ints[7] * real  # [B + pads] deferred features (0 for the pad rows: they project nothing)
            starts = (ints[2] - ints[7]) * real  # the drafter context's length before them
            if self.graphs is None:
                self.proposer.catch_up_rows(ints[0], starts, counts, capacity)
            else:
                self._replay_catch_up((ints[0], starts, counts), capacity)
            ints[7] = ints[7] * (1 - real)  # caught up: real rows start from lag 0
        return self._launch(rows, shape, width, ints, previous.floats)

    def finish(self, launched: LaunchedRound, meanwhile: Callable[[], None] | None = None) -> RoundResult:
        """Wait for ``launched``'s results (the host's one wait per round; ``meanwhile`` runs before it)."""
        if meanwhile is not None:
            meanwhile()
        if launched.done is not None:
            launched.done.synchronize()
        result = self._to_host(launched.host, len(launched.rows))
        if launched.logprobs is not None:
            ks = [r.params.logprobs for r in launched.rows]
            result = result._replace(logprobs=logprob_records(launched.logprobs, result.emitted, ks))
        if self.graphs is not None:
            self.timer.add("round", launched.launched_at)
            result = result._replace(captured_graph=launched.captured_graph)
        if self.tracer is not None:
            self.tracer.write(launched.rows, launched.trace)
        return result

    def has_graph(self, rows: Sequence[Request], nodes: int) -> bool:
        """A round of ``rows`` with ``nodes`` nodes would replay a captured CUDA graph (always
        true without graphs: nothing to capture)."""
        if self.graphs is None:
            return True
        return self.graphs.has((len(rows) + self._pad_rows(len(rows)), self._shape(rows, nodes)))

    def _launch(self, rows: list[Request], shape: RoundShape, width: int, ints: torch.Tensor,
                floats: torch.Tensor, grammar: GrammarRound | None = None,
                allotment: RowAllotment | None = None, option: int | None = None) -> LaunchedRound:
        """``grammar``: the rows with structured output (the round then runs eagerly). ``option``: the policy's
        node count the round stands for (default ``shape.nodes``; a packed round's trees are wider)."""
        launched_at = self.timer.mark()
        captures = self.graphs.captures if self.graphs is not None else 0
        inputs = RoundInputs.of(ints, floats)
        if self.graphs is None or grammar is not None:
            out = self.round_program(shape, *inputs, timer=self.timer, grammar=grammar, allotment=allotment)
        else:
            out = self.graphs.run((width, shape), lambda *t: self.round_program(shape, *t), inputs)
        host, trace, logprobs, done = out.packed, out.trace, out.logprobs, None
        if self.device.type == "cuda":  # read through an event: a later queued round need not finish first
            host = _pinned_copy(out.packed)
            trace = None if trace is None else tuple(_pinned_copy(t) for t in trace)
            logprobs = None if logprobs is None else TokenLogprobs(*(_pinned_copy(t) for t in logprobs))
            done = torch.cuda.Event()
            done.record()
        captured = self.graphs is not None and self.graphs.captures != captures
        return LaunchedRound(rows, shape.nodes if option is None else option, ints, floats, out.packed, host, trace,
                             logprobs, done, captured,
                             launched_at, grammar is not None,
                             verifies_packed(allotment, shape, grammar, self.proposer.chain))

    def _map_pages(self, rows: Sequence[Request]) -> None:
        """Map the KV pages every position a round of ``rows`` may write lies on (a queued round's rows
        that have finished since keep no pages: their writes go to the null page, their outputs are
        dropped)."""
        live = [r for r in rows if not r.finished]
        self.cache.pages.ensure([r.slot for r in live], [r.committed_length + self.span for r in live])

    def _plain_step(self, rows: int, pads: int) -> torch.Tensor:
        """``[8, rows + pads]``: what a plain round adds to a real row's inputs (starts, generated
        and lags + 1), nothing to a pad row's; cached per batch layout (sent without waiting for the rounds
        queued on the device: a new layout comes whenever a row finishes)."""
        key = (rows, pads)
        step = self._plain_steps.get(key)
        if step is None:
            step = torch.zeros(INT_FIELDS, rows + pads, dtype=torch.long)
            step[[2, 4, 7], :rows] = 1  # RoundInputs rows: starts, generated, lags
            step = self._plain_steps[key] = to_device(step, self.device)
        return step

    # ------------------------------------------------------------------ graphs captured at start-up
    def graph_keys(self, node_options: Sequence[int], max_rows: int, max_tokens: int,
                   max_round_tokens: int | None = None) -> list[tuple]:
        """The CUDA-graph keys of the rounds the engine may run, for :meth:`capture_graphs`: every
        padded row count up to ``max_rows``' with every node count of ``node_options`` whose round
        verifies at most ``max_tokens`` tokens (rows x (nodes + 1)) and that the scheduler's
        ``max_round_tokens`` lets run there (``policy.base.round_fits``), each greedy, sampled, and
        sampled with top-p / top-k (not with log-probabilities or adjusted logits: those rounds run
        eagerly); then the drafter's catch-up at every padded row count. Widest rounds first: the graphs
        share one memory pool, and a narrower capture reuses the blocks a wider one freed (captured the
        other way, each wider round adds its own blocks and the pool grows far past the widest round's
        peak; the activation reserve captures these keys once to measure the pool). Empty when a graph
        cannot serve every context length (attention over gathered pages keys graphs by length)."""
        if self.graphs is None or self.pad_slot is None:
            return []
        if not all(self.model.uses_kernel_attention(nodes + 1) for nodes in node_options):
            return []
        widths = [1 << i for i in range(rows_width(max_rows).bit_length())]  # 1, 2, 4, ... padded rows
        capacity = self.cache.spec.capacity
        keys = [(width, self._packed(RoundShape(capacity, sampled, filtered, nodes), width))
                for width in widths for nodes in node_options
                if width * (nodes + 1) <= max_tokens and round_fits(width, nodes, max_round_tokens)
                for sampled, filtered in ((True, True), (True, False), (False, False))]
        keys.sort(key=lambda key: verified_tokens(*key), reverse=True)  # widest first (stable: filtered first)
        if any(node_options) and self.proposer.max_nodes > 0:
            keys += [self._catch_up_key(width, self.proposer.lag.capacity) for width in reversed(widths)]
        return keys

    def capture_graphs(self, keys: Sequence[tuple]) -> None:
        """Capture the graph of each key (from :meth:`graph_keys`) by running it once on pad rows,
        then freeze the cache: from now on a round with no graph runs eagerly, never captures."""
        for key in keys:
            if key[0] == "catch_up":
                width = key[1]
                pads = torch.tensor([[self.pad_slot] * width, [0] * width, [0] * width])  # [3, W]: slot, start, count
                self._replay_catch_up(to_device(pads, self.device).unbind(0), key[2])
                continue
            width, shape = key
            ints, floats = self._round_inputs([], 0, pads=width)  # pad rows only
            self.graphs.run(key, lambda *t, shape=shape: self.round_program(shape, *t), RoundInputs.of(ints, floats))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-up runs' cached blocks: the pool's size left room for the graphs only
        self.graphs.freeze()

    def round_variants(self, rows: int, nodes: int) -> list[tuple]:
        """(padded rows, RoundShape) keys of a round of ``rows`` rows and ``nodes`` nodes at full context: greedy,
        sampled with top-p, and with log-probabilities (which no graph holds), for :meth:`run_on_pad_rows`."""
        width = rows + self._pad_rows(rows)  # (padded as a round of that many rows would be)
        capacity = self.cache.spec.capacity
        return [(width, self._packed(RoundShape(capacity, sampled, filtered, nodes, logprobs), width))
                for sampled, filtered, logprobs in ((False, False, None), (True, True, None), (True, True, MAX_LOGPROBS))]

    def run_on_pad_rows(self, key: tuple) -> None:
        """Run the round of ``key`` (a graph key or from :meth:`round_variants`) once, eagerly, on pad rows only."""
        width, shape = key
        ints, floats = self._round_inputs([], 0, pads=width)
        self.round_program(shape, *RoundInputs.of(ints, floats))

    # ------------------------------------------------------------------ the drafter's catch-up
    def catch_up_drafter(self, rows: Sequence[Request]) -> bool:
        """The proposer projects the context features it deferred for ``rows`` (their lag each,
        after the ``committed_length - lag`` tokens its context holds). With graphs on it replays
        the full-width catch-up's CUDA graph (``lag.capacity`` columns whatever the largest lag; the
        rows padded to a power of two with the pad slot, whose count 0 projects nothing): eager,
        its launches cost more than its device work. Returns whether it captured a graph."""
        lag = self.proposer.lag
        slots, lags = [r.slot for r in rows], [lag.of(r) for r in rows]
        starts = [r.committed_length - n for r, n in zip(rows, lags)]
        if self.graphs is None or self.pad_slot is None:
            width = max(lags, default=0)
            if width:
                host = torch.tensor([slots, starts, lags], dtype=torch.long)  # [3, B]
                self.proposer.catch_up_rows(*host.to(self.device).unbind(0), width)
            return False
        pads = self._pad_rows(len(rows))
        host = torch.tensor([slots + [self.pad_slot] * pads, starts + [0] * pads, lags + [0] * pads])  # [3, B + pads]
        captures = self.graphs.captures
        self._replay_catch_up(to_device(host, self.device).unbind(0), lag.capacity)
        return self.graphs.captures != captures

    @staticmethod
    def _catch_up_key(padded_rows: int, width: int) -> tuple:
        return ("catch_up", padded_rows, width)

    def _replay_catch_up(self, rows: Sequence[torch.Tensor], width: int) -> None:
        """The graphed catch-up of ``rows`` = (slots, starts, counts), each ``[B + pads]``."""
        self.graphs.run(self._catch_up_key(len(rows[0]), width),
                        lambda *t: self.proposer.catch_up_rows(*t, width), tuple(rows))

    # ------------------------------------------------------------------ inputs and shapes
    def _pad_rows(self, rows: int) -> int:
        """Pad rows a graphed round adds: up to the next power of two."""
        if self.graphs is None or self.pad_slot is None:
            return 0
        return rows_width(rows) - rows

    def _shape(self, rows: Sequence[Request], nodes: int, ahead: int = 0) -> RoundShape:
        """The round's static shape (with graphs: its key-length bucket); ``ahead``: tokens the rows
        will have committed by then beyond what the host knows (see :meth:`launch_plain_after`)."""
        params = [r.params for r in rows]  # (log-probabilities: always the most alternatives, so one graph)
        shape = RoundShape(kv_len=0, any_sampled=any(not p.greedy for p in params),
                           any_filtered=any(not p.greedy and (p.top_p < 1 or p.top_k > 0) for p in params),
                           nodes=nodes, logprobs=MAX_LOGPROBS if any(p.logprobs is not None for p in params) else None,
                           adjust=any(p.adjusts for p in params))
        if not GrammarRound.needed(rows):  # (a grammar's rounds keep their rows' own trees)
            shape = self._packed(shape, len(rows) + self._pad_rows(len(rows)))
        kv_len = max(r.committed_length for r in rows) + ahead + shape.nodes + 1
        if self.model.uses_kernel_attention(shape.nodes + 1):  # it reads lengths and block tables itself: one graph
            kv_len = self.cache.spec.capacity  # for all
        if self.graphs is not None:
            kv_len = self._kv_bucket(kv_len)  # (capacity stays capacity)
        return shape._replace(kv_len=kv_len)

    def _packed(self, shape: RoundShape, width: int) -> RoundShape:
        """``shape`` in the packed layout where the runner uses it: a drafted round of n nodes per row over ``width``
        rows (pads included) verifies ``width x (n + 1)`` tokens, packed, each row's best nodes from a tree of up to
        ``PACKED_TREE_SPAN x n`` (the round's allotment, ``engine/round.up_to_total``). Rounds that adjust their
        logits keep the padded layout."""
        if not self.packed or shape.nodes == 0 or shape.adjust:
            return shape
        return shape._replace(nodes=min(self.proposer.max_nodes, PACKED_TREE_SPAN * shape.nodes),
                              tokens=width * (shape.nodes + 1))

    def _kv_bucket(self, kv_len: int) -> int:
        return min(-(-kv_len // KV_BUCKET) * KV_BUCKET, self.cache.spec.capacity)

    def _round_inputs(self, rows: Sequence[Request], nodes: int, pads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' inputs on the device (``[8, B + pads]`` integers in RoundInputs' order,
        ``[2, B + pads]`` temperature and top_p), sent in two non-blocking copies from pinned memory
        (a copy from pageable memory would make the host wait for all queued device work).

        ``pads`` pad rows follow the real ones: all on the pad slot with identical inputs (token 0
        at position 0, greedy, budget 0, a full lag: deferred features go to the padding column),
        so they write identical values to the same pad-slot entries and their outputs are dropped."""
        lag = self.proposer.lag
        params = [r.params for r in rows]
        per_row = [(r.slot, r.output_ids[-1], r.committed_length, nodes if r.budget is None else min(r.budget, nodes),
                    len(r.output_ids), p.top_k, seed_value(p), lag.of(r)) for r, p in zip(rows, params)]
        per_row += [(self.pad_slot, 0, 0, 0, 0, 0, 0, lag.capacity)] * pads
        ints = torch.tensor(per_row, dtype=torch.long).T.contiguous()  # [8, B + pads]
        temperature_top_p = [(p.temperature, p.top_p) for p in params] + [(0.0, 1.0)] * pads
        floats = torch.tensor(temperature_top_p).T.contiguous()  # [2, B + pads]
        return to_device(ints, self.device), to_device(floats, self.device)

    @staticmethod
    def _to_host(packed: torch.Tensor, rows: int) -> RoundResult:
        host = packed[:rows].tolist()
        return RoundResult(emitted=[row[2:2 + row[0]] for row in host], tree_sizes=[row[1] for row in host])


def verified_tokens(width: int, shape: RoundShape) -> int:
    """Tokens the verify forward of a round of ``width`` rows (pads included) and ``shape`` runs."""
    return shape.tokens if shape.tokens is not None else width * (shape.nodes + 1)


def rows_width(rows: int) -> int:
    """Rows of a graphed round of ``rows`` real rows: the next power of two (pad rows fill it)."""
    return 1 << (rows - 1).bit_length()


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of a device tensor into pinned host memory (valid once the stream reaches it)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
