"""ModelRunner: the target model, its KV cache and the two things a step does with them.

- ``prefill``: run a chunk of each row's prompt, commit it, hand the context features to the
  proposer, and choose the first output token for rows whose prompt is complete.
- ``round``: draft (proposer) -> verify the tree with one target pass -> choose the target's
  token at every node -> accept walk -> commit the accepted path's KV and features. The
  caller picks the round's node count (``nodes``, the drafted nodes per row; part of the
  round's static shape); 0 is a plain round: the root-only tree and no drafter pass, while the
  drafter still observes the committed tokens' context features so it stays in sync.

Both end with exactly one host sync: the tokens the scheduler needs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

import torch

from flashtree.device_copy import to_device
from flashtree.engine.graphs import GraphCache
from flashtree.engine.request import Request
from flashtree.engine.tree_trace import TreeTracer
from flashtree.kv.cache import KVCache
from flashtree.models.batch import ForwardBatch, causal_mask, slot_range_of
from flashtree.models.transformer import CausalLM
from flashtree.sampling import SamplingTensors, choose_tokens, seed_value
from flashtree.speculative.proposer import Proposer, root_only_tree
from flashtree.speculative.verify import accept_walk


class RoundInputs(NamedTuple):
    """A round's per-row inputs (all ``[B]`` device tensors); also what proposers see."""

    slots: torch.Tensor  # KV slot
    bonus: torch.Tensor  # bonus token (root of the tree)
    starts: torch.Tensor  # position of the bonus token = committed length
    budgets: torch.Tensor  # tree budget
    generated: torch.Tensor  # output tokens so far (the bonus is output index generated-1)
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    lags: torch.Tensor  # the drafter's deferred tokens of the row before this round (see DrafterRunner.defer)


class RoundShape(NamedTuple):
    """The static (host) facts a round's device work depends on; part of the graph key."""

    kv_len: int
    slot_range: tuple[int, int] | None
    any_sampled: bool
    any_filtered: bool
    nodes: int  # drafted nodes per row (the tree has nodes + 1 entries); 0: plain round


class RoundResult(NamedTuple):
    emitted: list[list[int]]  # per row: accepted drafts + next bonus (= acceptance length tokens)
    tree_sizes: list[int]  # per row: drafted nodes verified
    captured_graph: bool = False  # this round captured a CUDA graph (its wall time is not typical)


class LaunchedRound(NamedTuple):
    """A round whose device work is queued and whose results the host has not read yet
    (:meth:`ModelRunner.launch`; read with :meth:`ModelRunner.finish`)."""

    rows: list[Request]  # the real rows, in the round's order (pad rows follow them on the device)
    nodes: int
    ints: torch.Tensor  # [8, B + pads] the RoundInputs' integer rows on the device (slots ... lags)
    floats: torch.Tensor  # [2, B + pads] temperature, top_p
    packed: torch.Tensor  # [B + pads, 2 + D + 1] see ModelRunner._pack (a graph's static buffer)
    host: torch.Tensor  # packed, copied to (pinned) host memory once ``done``
    done: object  # a torch.cuda.Event recorded after that copy (None on a CPU: already done)
    captured_graph: bool  # launching it captured a CUDA graph
    launched_at: float  # perf_counter() when its device work was queued


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
    def __init__(self, model: CausalLM, cache: KVCache, proposer: Proposer, timer: StageTimer,
                 cuda_graphs: bool = False, tracer: TreeTracer | None = None, pad_slot: int | None = None):
        """``pad_slot``: a KV slot no request uses; graphed rounds pad their rows with it up to the
        next power of two, so a handful of graphs serves every batch size (None: no padding)."""
        self.model, self.cache, self.proposer, self.timer = model, cache, proposer, timer
        self.device = model.lm_head.weight.device
        self.tracer = tracer
        use_graphs = cuda_graphs and self.device.type == "cuda" and not timer.sync and tracer is None
        self.graphs = GraphCache() if use_graphs else None
        self.pad_slot = pad_slot
        # prefill attention builds no per-shape plan (models/attention.py); False: PyTorch's choice
        # (cuDNN on the H200), for comparisons (benchmarks/gpu_prefill_shapes.py)
        self.planless_prefill = True
        # plain rounds skip the root-only tree and its accept walk (_plain_round_device); False:
        # the general path, for comparisons
        self.plain_fast_path = True
        # a plain round's drafter features go into the lag buffer from the fused norm (a feature
        # sink, models/feature_sink.py); False: returned and deferred after the forward, for comparisons
        self.use_feature_sink = True
        # the host returns from queuing a round's device work before the device is done with it
        # (CUDA); on a CPU the work runs as it is queued
        self.runs_ahead = self.device.type == "cuda"
        self._plain_steps: dict[tuple[int, int], torch.Tensor] = {}  # see _plain_step

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, rows: Sequence[Request], chunk: int, defer: Sequence[bool] | None = None) -> list[int | None]:
        """Run the next prompt chunk of every row; returns the first output token of rows whose
        prompt completed (None for rows still prefilling). ``defer[i]``: the proposer keeps row
        i's context features for a later catch-up instead of projecting them now (the caller
        checked that they fit its lag)."""
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
            kv_len=max(r.prefilled for r in rows) + width, slot_range=slot_range_of(slots_list),
            one_off_shape=self.planless_prefill)
        last = (counts - 1)[:, None]  # [B, 1]
        out = self.model(batch, self.cache, logits_index=last, capture_layers=self.proposer.capture_layers)
        self.cache.advance(slots, counts)
        if out.hidden is not None:
            self._hand_features(rows, slots, out.hidden, counts, starts, defer)
        sampling = SamplingTensors.build([r.params for r in rows], self.device)
        first = choose_tokens(out.logits, sampling, torch.zeros_like(last))[:, 0].tolist()  # the one sync
        self.timer.add("prefill", t0)
        done = [r.prefilled + len(p) == len(r.prompt_ids) for r, p in zip(rows, pieces)]
        return [tok if d else None for tok, d in zip(first, done)]

    def _hand_features(self, rows: Sequence[Request], slots: torch.Tensor, hidden: torch.Tensor, counts: torch.Tensor,
                       starts: torch.Tensor, defer: Sequence[bool] | None) -> None:
        """A prefill chunk's context features ``[B, W, F]`` to the proposer: deferred for the rows
        ``defer`` marks (after their lag so far), projected now for the others (each call sees the
        other rows' counts as 0)."""
        if not defer or not any(defer):
            self.proposer.observe(slots, hidden, counts, starts)
            return
        lags = self._tensor([r.drafter_lag for r in rows])  # [B]
        deferred = self._tensor([int(d) for d in defer])  # [B] 1: deferred
        self.proposer.defer(slots, hidden, lags, counts * deferred)
        if not all(defer):
            self.proposer.observe(slots, hidden, counts * (1 - deferred), starts)

    def round(self, rows: Sequence[Request], nodes: int | None = None, meanwhile: Callable[[], None] | None = None
              ) -> RoundResult:
        """One round for the running rows verifying ``nodes`` drafted nodes per row (default and
        at most ``proposer.max_nodes``; rows' own budgets cap theirs); the device work is
        replayed as a CUDA graph when enabled (captured first if its key is new). ``meanwhile``:
        host work to do once the round's device work is queued, before the host waits for it (on
        a device that runs ahead of the host, see ``runs_ahead``, it then costs the round nothing)."""
        return self.finish(self.launch(rows, nodes), meanwhile)

    def launch(self, rows: Sequence[Request], nodes: int | None = None) -> LaunchedRound:
        """Queue :meth:`round`'s device work; :meth:`finish` reads its results."""
        nodes = self.proposer.max_nodes if nodes is None else nodes
        if not 0 <= nodes <= self.proposer.max_nodes:
            raise ValueError(f"nodes must be in [0, {self.proposer.max_nodes}], got {nodes}")
        slots_list = self._padded_slots(rows)
        shape = self._shape(rows, nodes, slots_list)
        ints, floats = self._round_inputs(rows, nodes, len(slots_list) - len(rows))
        return self._launch(list(rows), shape, len(slots_list), ints, floats)

    def launch_plain_after(self, previous: LaunchedRound, catch_up: bool = False) -> LaunchedRound | None:
        """Queue the plain round that follows the plain round ``previous`` for the same rows, before
        the host has read ``previous``: its inputs come from ``previous``'s on the device (the bonus
        token is the one ``previous`` chooses; position, output count and drafter lag one further
        for the real rows, the pad rows' unchanged). ``catch_up``: the drafter first projects every
        row's deferred features (its lag by then: one more than ``previous``'s), as
        :meth:`catch_up_drafter` does when a row's lag is full, and the round starts from lag 0. The
        caller checked that every row has room for the token. None (nothing queued) when a CUDA
        graph it needs is not captured yet: a capture would wait for the device."""
        if previous.nodes != 0:
            raise ValueError("only a plain round's successor can be queued before its results are read")
        rows = previous.rows
        slots_list = self._padded_slots(rows)
        width, pads = len(slots_list), len(slots_list) - len(rows)
        shape = self._shape(rows, 0, slots_list, ahead=1)
        if self.graphs is not None and not self.graphs.has((width, shape)):
            return None
        capacity = getattr(self.proposer, "lag_capacity", 0)
        if catch_up and self.graphs is not None and not self.graphs.has(self._catch_up_key(width, capacity)):
            return None
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

    def _plain_step(self, rows: int, pads: int) -> torch.Tensor:
        """``[8, rows + pads]``: what a plain round adds to a real row's inputs (starts, generated
        and lags + 1), nothing to a pad row's; cached per batch layout."""
        key = (rows, pads)
        step = self._plain_steps.get(key)
        if step is None:
            step = torch.zeros(8, rows + pads, dtype=torch.long)
            step[[2, 4, 7], :rows] = 1  # RoundInputs rows: starts, generated, lags
            step = self._plain_steps[key] = step.to(self.device)
        return step

    def _launch(self, rows: list[Request], shape: "RoundShape", width: int, ints: torch.Tensor,
                floats: torch.Tensor) -> LaunchedRound:
        launched_at = self.timer.mark()
        captures = self.graphs.captures if self.graphs is not None else 0
        slots, bonus, starts, budgets, generated, top_k, seed, lags = ints.unbind(0)
        inputs = RoundInputs(slots, bonus, starts, budgets, generated, floats[0], floats[1], top_k, seed, lags)
        if self.graphs is None:
            packed = self._round_device(shape, *inputs, timer=self.timer)
        else:
            packed = self.graphs.run((width, shape), lambda *t: self._round_device(shape, *t), inputs)
        host, done = packed, None
        if self.device.type == "cuda":  # read through an event: a later queued round need not finish first
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        captured = self.graphs is not None and self.graphs.captures != captures
        return LaunchedRound(rows, shape.nodes, ints, floats, packed, host, done, captured, launched_at)

    def finish(self, launched: LaunchedRound, meanwhile: Callable[[], None] | None = None) -> RoundResult:
        """Wait for ``launched``'s results (the host's one wait per round; ``meanwhile`` runs before it)."""
        if meanwhile is not None:
            meanwhile()
        if launched.done is not None:
            launched.done.synchronize()
        result = self._to_host(launched.host, len(launched.rows))
        if self.graphs is not None:
            self.timer.add("round", launched.launched_at)
            result = result._replace(captured_graph=launched.captured_graph)
        if self.tracer is not None:
            self.tracer.write(launched.rows)
        return result

    def catch_up_drafter(self, rows: Sequence[Request]) -> bool:
        """The proposer projects the context features it deferred for ``rows`` (``drafter_lag`` each,
        after the ``committed_length - drafter_lag`` tokens its context holds). When graphs are on
        it replays the full-width catch-up's CUDA graph (``lag_capacity`` columns, whatever the
        largest lag; the rows padded to a power of two with the pad slot, whose count 0 projects
        nothing): eager, its launches cost more than its device work, and the device sat idle for
        2.5-4 ms of an eager catch-up before a probe at one row on the H200 (benchmarks/README.md,
        "Fifteenth session"). Returns whether it captured a graph."""
        slots, lags = [r.slot for r in rows], [r.drafter_lag for r in rows]
        starts = [r.committed_length - r.drafter_lag for r in rows]
        width = self.proposer.lag_capacity
        if self.graphs is None or self.pad_slot is None:
            self.proposer.catch_up(slots, starts, lags)
            return False
        pads = self._pad_rows(len(rows))
        host = torch.tensor([slots + [self.pad_slot] * pads, starts + [0] * pads, lags + [0] * pads])  # [3, B + pads]
        captures = self.graphs.captures
        self._replay_catch_up(to_device(host, self.device).unbind(0), width)
        return self.graphs.captures != captures

    @staticmethod
    def _catch_up_key(padded_rows: int, width: int) -> tuple:
        return ("catch_up", padded_rows, width)

    def _replay_catch_up(self, rows: Sequence[torch.Tensor], width: int) -> None:
        """The graphed catch-up of ``rows`` = (slots, starts, counts), each ``[B + pads]``."""
        self.graphs.run(self._catch_up_key(len(rows[0]), width),
                        lambda *t: self.proposer.catch_up_rows(*t, width), tuple(rows))

    def has_graph(self, rows: Sequence[Request], nodes: int) -> bool:
        """A round of ``rows`` with ``nodes`` nodes would replay a captured CUDA graph (always
        true without graphs: nothing to capture)."""
        if self.graphs is None:
            return True
        slots_list = self._padded_slots(rows)
        return self.graphs.has((len(slots_list), self._shape(rows, nodes, slots_list)))

    def _padded_slots(self, rows: Sequence[Request]) -> list[int]:
        """The rows' KV slots, then the pad slot for each pad row (see ``_pad_rows``)."""
        return [r.slot for r in rows] + [self.pad_slot] * self._pad_rows(len(rows))

    def _shape(self, rows: Sequence[Request], nodes: int, slots_list: list[int], ahead: int = 0) -> RoundShape:
        """The round's static shape (with graphs: its key-length bucket); ``ahead``: tokens the rows
        will have committed by then beyond what the host knows (see :meth:`launch_plain_after`)."""
        params = [r.params for r in rows]
        shape = RoundShape(kv_len=max(r.committed_length for r in rows) + ahead + nodes + 1,
                           slot_range=slot_range_of(slots_list), any_sampled=any(not p.greedy for p in params),
                           any_filtered=any(not p.greedy and (p.top_p < 1 or p.top_k > 0) for p in params),
                           nodes=nodes)
        if self.model.uses_kernel_attention(nodes + 1):  # it reads lengths and slots itself: one graph for all
            shape = shape._replace(kv_len=self.cache.spec.capacity, slot_range=None)
        if self.graphs is not None:
            shape = shape._replace(kv_len=self._kv_bucket(shape.kv_len))  # (capacity stays capacity)
        return shape

    def _pad_rows(self, rows: int) -> int:
        """Pad rows a graphed round adds: up to the next power of two."""
        if self.graphs is None or self.pad_slot is None:
            return 0
        return (1 << (rows - 1).bit_length()) - rows

    def _round_inputs(self, rows: Sequence[Request], nodes: int, pads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' inputs on the device (``[8, B + pads]`` integers in RoundInputs' order,
        ``[2, B + pads]`` temperature and top_p), sent in two non-blocking copies from pinned memory
        (a copy from pageable memory would make the host wait for all queued device work).

        ``pads`` pad rows follow the real ones: all on the pad slot with identical inputs (token 0
        at position 0, greedy, budget 0, a full lag: deferred features go to the padding column),
        so they write identical values to the same pad-slot entries and their outputs are dropped."""
        params = [r.params for r in rows]
        per_row = [(r.slot, r.output_ids[-1], r.committed_length, nodes if r.budget is None else min(r.budget, nodes),
                    len(r.output_ids), p.top_k, seed_value(p), r.drafter_lag) for r, p in zip(rows, params)]
        per_row += [(self.pad_slot, 0, 0, 0, 0, 0, 0, getattr(self.proposer, "lag_capacity", 0))] * pads
        ints = torch.tensor(per_row, dtype=torch.long).T.contiguous()  # [8, B + pads]
        temperature_top_p = [(p.temperature, p.top_p) for p in params] + [(0.0, 1.0)] * pads
        floats = torch.tensor(temperature_top_p).T.contiguous()  # [2, B + pads]
        return to_device(ints, self.device), to_device(floats, self.device)

    @staticmethod
    def _sampling(shape: "RoundShape", rows: RoundInputs) -> SamplingTensors:
        return SamplingTensors(rows.temperature, rows.top_p, rows.top_k, rows.seed, shape.any_sampled,
                               shape.any_filtered)

    def _kv_bucket(self, kv_len: int) -> int:
        bucket = 256
        return min(-(-kv_len // bucket) * bucket, self.cache.spec.capacity)

    def _round_device(self, shape: "RoundShape", *tensors: torch.Tensor, timer: StageTimer | None = None):
        """draft -> verify -> choose -> walk -> commit, all on the device; returns the packed
        ``[B, 2 + D + 1]`` (acceptance length, tree size, emitted tokens) for the host, with
        D = min(max_depth, nodes) the round's deepest node."""
        rows = RoundInputs(*tensors)
        nodes = shape.nodes
        if nodes == 0 and self.plain_fast_path and self.tracer is None:
            return self._plain_round_device(shape, rows, timer)
        t0 = timer.mark() if timer else 0.0
        tree = self.proposer.propose(rows, nodes) if nodes else root_only_tree(rows.bonus)  # N = nodes + 1
        tokens = torch.cat([rows.bonus[:, None], tree.tokens[:, 1:].clamp(min=0)], dim=1)  # [B, T+1]
        t1 = timer.add("draft", t0) if timer else 0.0

        batch = ForwardBatch(
            input_ids=tokens, positions=rows.starts[:, None] + tree.depths, slots=rows.slots,
            cache_lengths=rows.starts, new_mask=tree.ancestor_mask, kv_len=shape.kv_len,
            slot_range=shape.slot_range)
        out = self.model(batch, self.cache, capture_layers=self.proposer.capture_layers)
        sampling = self._sampling(shape, rows)
        choice = choose_tokens(out.logits, sampling, rows.generated[:, None] + tree.depths)  # [B, T+1]
        t2 = timer.add("verify", t1) if timer else 0.0

        depth = min(self.proposer.max_depth, nodes)  # deepest node of this round's trees
        walk = accept_walk(tree._replace(tokens=tokens), choice, depth,
                           kernel=getattr(self.proposer, "tree_kernel", False))
        if self.tracer is not None:
            self.tracer.hold(tree, tokens, walk.path)
        path = walk.path.clamp(min=0)  # [B, D+1]
        if getattr(self.proposer, "chain", False) or nodes == 0:
            self.cache.commit_prefix(rows.slots, rows.starts, walk.accept_lengths)
        else:
            self.cache.commit(rows.slots, rows.starts, path, walk.accept_lengths)
        if out.hidden is not None and nodes == 0 and hasattr(self.proposer, "defer"):
            self.proposer.defer(rows.slots, out.hidden[:, :1], rows.lags)  # projected at the next drafted round
        elif out.hidden is not None:  # the drafter sees every committed token
            features = out.hidden.gather(1, path[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
            self.proposer.observe(rows.slots, features, walk.accept_lengths, rows.starts)
        packed = self._pack(walk, tree.valid)
        if timer:
            timer.add("commit", t2)
        return packed

    def _plain_round_device(self, shape: "RoundShape", rows: RoundInputs, timer: StageTimer | None) -> torch.Tensor:
        """A plain round (``nodes`` 0) without the tree machinery: the root-only tree's walk always
        accepts the root and nothing else, so the round is forward -> choose -> commit the one
        token. Same values as the general path (tests/test_plain_round.py compares them); it
        skips the tree's tensors and the accept walk's ops (tens of small kernels)."""
        t0 = timer.mark() if timer else 0.0
        num_rows = rows.bonus.shape[0]
        root_mask = torch.ones(num_rows, 1, 1, dtype=torch.bool, device=rows.bonus.device)  # [B, 1, 1]
        batch = ForwardBatch(
            input_ids=rows.bonus[:, None], positions=rows.starts[:, None], slots=rows.slots,
            cache_lengths=rows.starts, new_mask=root_mask, kv_len=shape.kv_len, slot_range=shape.slot_range)
        # a drafter's features go straight to its lag buffer (projected at the next drafted round)
        sinks = self.use_feature_sink and hasattr(self.proposer, "feature_sink")
        sink = self.proposer.feature_sink(rows.slots, rows.lags) if sinks else None
        out = self.model(batch, self.cache, capture_layers=self.proposer.capture_layers, feature_sink=sink)
        next_bonus = choose_tokens(out.logits, self._sampling(shape, rows), rows.generated[:, None])[:, 0].long()  # [B]
        t1 = timer.add("verify", t0) if timer else 0.0
        ones = torch.ones_like(rows.slots)  # [B] accept length 1: the root
        self.cache.commit_prefix(rows.slots, rows.starts, ones)
        if out.hidden is not None and hasattr(self.proposer, "defer"):  # (no sink)
            self.proposer.defer(rows.slots, out.hidden, rows.lags)  # [B, 1, F]
        elif out.hidden is not None:
            self.proposer.observe(rows.slots, out.hidden, ones, rows.starts)
        packed = torch.stack([ones, torch.zeros_like(ones), next_bonus], dim=1)  # [B, 3], as _pack's
        if timer:
            timer.add("commit", t1)
        return packed

    @staticmethod
    def _pack(walk, valid: torch.Tensor) -> torch.Tensor:
        """Emitted tokens per row: the accepted drafts (committed path minus the old bonus) and
        then the next bonus; their number is the acceptance length. ``[B, 2 + D + 1]``."""
        counts = walk.accept_lengths  # [B]
        pad = torch.full_like(walk.next_bonus[:, None], -1)
        emitted = torch.cat([walk.committed_tokens[:, 1:], pad], dim=1)  # [B, D+1]
        emitted = emitted.scatter(1, (counts - 1)[:, None], walk.next_bonus[:, None])
        sizes = valid.sum(1, keepdim=True) - 1  # [B, 1] drafted nodes
        return torch.cat([counts[:, None], sizes, emitted], dim=1)

    @staticmethod
    def _to_host(packed: torch.Tensor, rows: int) -> RoundResult:
        host = packed[:rows].tolist()
        return RoundResult(emitted=[row[2:2 + row[0]] for row in host], tree_sizes=[row[1] for row in host])
