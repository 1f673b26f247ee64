"""LLMEngine: load models, take requests, and advance every active request one step at a time.

``step()`` is the whole loop: schedule -> one round for the running rows -> one prefill chunk
for the admitted rows -> append committed tokens (stop conditions) -> free finished slots.
Each round's node count comes from the speculation policy (``engine/spec_policy.py``), which
is fed the round's wall time and acceptance afterwards (not the wall time of a round after an
idle pause, see ``IDLE_GAP_S``, of a round that captured a CUDA graph, or of the first round of
a node count at a rows bucket: a warm-up, e.g. 3.1 against 2.0 ms for a tiny pair's first tree
round on a CPU, and one slow sample of the smallest tree caps every tree's score by the
policy's monotone round times).

Probes and CUDA graphs: a graph is captured per round shape (rows, key-length bucket, slot
range, node count), and capturing one costs tens of plain rounds or more (H200, Qwen3-8B shape:
0.1-0.3 s, 1.3 s with a Triton compile). The policy's neighbour probes try an option for a round
or a few, often at a shape never seen with that node count (slot ranges change as requests come
and go). A neighbour probe whose round has no captured graph is therefore declined unless its
option could beat the best one (``SpecPolicy.worth_a_graph``); the round runs the best option
instead, and the policy waits longer before the next probe. A drafter that never matches then
costs no captures after its first bucket. (Running such probes eagerly instead, untimed, took
85-250 ms a round at 4-32 rows on the H200, and an untimed probe never backed off: one every
50 rounds cost DDTree and DFlash servers 15-28% of a pass; benchmarks/README.md, "Tenth session".)

Queued plain rounds: between two rounds the host appends the committed tokens (stop checks, text),
schedules and builds the next round's inputs: 0.35-0.57 ms per step on the H200 at 1-32 rows
(benchmarks/README.md, "Third session"), time the device sits idle if each round waits for the one
before it to be read. A plain round's successor needs nothing the host has to read first: its
bonus token is the one the round chooses (on the device), and its positions, output count and
drafter lag are one further. So when this round is plain, the policy is settled on plain rounds
(``settled_on_plain``) and no prefill runs this step, the policy chooses the next round's node
count before this round's results are read; if it is plain (also when it was a neighbour probe the
engine declines, see above), the next round is queued right behind this one
(``ModelRunner.launch_plain_after``; with the drafter catch-up first when a row's lag is full), and
the device runs it while the host does this step's work; otherwise the next step runs the chosen
round as usual.
Rows that finish in this step (a stop token, an abort) ran one more token in the queued round; it
is dropped, and their slots are freed behind it on the device. A queued round's wall time for the
policy runs from the previous round's end to its own (the device's pace). Only plain rounds are
queued: a drafted round's successor depends on how many tokens it accepts. Lossless as before: a
queued round computes exactly what the same round run a step later would.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple, Sequence

import torch

from flashtree.config import EngineConfig
from flashtree.device_copy import to_device
from flashtree.engine.output import StepEvent, TextTracker, append_tokens
from flashtree.engine.policy_trace import PolicyTracer
from flashtree.engine.request import Request, Status
from flashtree.engine.runner import ModelRunner, RoundResult, StageTimer
from flashtree.engine.scheduler import Scheduler
from flashtree.policy.adaptive import FixedNodes, SpecPolicy, node_ladder, rows_bucket
from flashtree.engine.step_trace import StepTracer
from flashtree.engine.tree_trace import TreeTracer
from flashtree.errors import RequestError
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.kernels import gpu as gpu_kernels
from flashtree.models.build import build_model, resolve_device, resolve_dtype
from flashtree.models.gguf_blocks import maybe_attach_quantized
from flashtree.models.loader import load_checkpoint
from flashtree.models.transformer import CausalLM
from flashtree.sampling import SamplingParams
from flashtree.speculative.registry import make_proposer
from flashtree.models.tokenizer import stop_token_ids_for


class LoadedTarget(NamedTuple):
    """A built target model and its tokenizer; engines given the same one share its weights."""

    model: CausalLM
    tokenizer: object  # transformers tokenizer or None


def load_target(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedTarget:
    checkpoint = load_checkpoint(config.model, random_weights=config.random_weights)
    model = build_model(checkpoint.config, checkpoint.weights, device, dtype, seed=config.seed)
    maybe_attach_quantized(model, checkpoint, enabled=config.quant_kernels)  # CPU fp32 GGUF models
    model.use_fused_kernels(config.gpu_kernels, config.cpu_kernels, attention=config.triton_attention)
    return LoadedTarget(model, checkpoint.tokenizer)


class LLMEngine:
    def __init__(self, config: EngineConfig, target: LoadedTarget | None = None):
        """``target``: reuse an already loaded target (built for this config's device and dtype)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        t0 = time.perf_counter()
        self.model, self.tokenizer = target or load_target(config, self.device, self.dtype)
        self.proposer = make_proposer(config, self.model, self.tokenizer)
        scratch = self.proposer.max_nodes + 1
        cfg = self.model.config
        spec = KVCacheSpec(cfg.num_hidden_layers, config.max_running + 1, config.max_context,  # + the pad slot
                           max(scratch, config.prefill_chunk), cfg.num_key_value_heads, cfg.head_dim)
        self.cache = KVCache(spec, self.dtype, self.device)
        self.cache.commit_kernel = config.gpu_kernels and config.triton_tree and gpu_kernels.usable_on(self.cache.storage)
        self.model.setup_rope(spec.capacity + 1)
        self.timer = StageTimer(self.device, config.profile_stages)
        tracer = TreeTracer(config.trace_trees) if config.trace_trees else None
        self.runner = ModelRunner(self.model, self.cache, self.proposer, self.timer, config.cuda_graphs, tracer,
                                  pad_slot=config.max_running)
        self.scheduler = Scheduler(config)
        self.policy = make_policy(config, self.proposer)
        self.rounds_by_nodes: Counter[int] = Counter()  # batched rounds per chosen node count
        self._last_step_end = float("-inf")  # perf_counter() when the last step ended
        self._untimed_round = False  # the next round follows an idle pause: not timed for the policy
        self._warmed_options: set[tuple[int, int]] = set()  # (rows bucket, nodes) run at least once
        self._last_round_end = float("-inf")  # perf_counter() when the host last read a round's results
        self._ahead = None  # LaunchedRound queued for the next step (see "Queued plain rounds")
        self.queued_rounds = 0  # rounds that were queued before the round ahead of them was read
        self._chosen_ahead: int | None = None  # the next round's node count, chosen in the last step
        self.queue_plain_rounds = (config.queue_plain_rounds if config.queue_plain_rounds is not None
                                   else self.runner.runs_ahead) and self.runner.tracer is None
        self.last_round_nodes: int | None = None  # node count of the last step's round (None: no round)
        self.policy_tracer = PolicyTracer(config.trace_policy) if config.trace_policy else None
        self.step_tracer = StepTracer(config.trace_steps) if config.trace_steps else None
        self.tracker = TextTracker(self.tokenizer, config.incremental_text)
        self.default_stop_ids = frozenset(stop_token_ids_for(cfg, self.tokenizer))
        self.load_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, budget: int | None = None) -> Request:
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is out of range; allowed: integers in [0, {vocab})")
        params = params.with_seed()
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.default_stop_ids))
        req = Request(prompt_ids=list(prompt_ids), params=params, stop_token_ids=frozenset(stop_ids), budget=budget)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[StepEvent]:
        started = time.perf_counter()
        if started - self._last_step_end > IDLE_GAP_S:  # the engine sat idle before this step
            self._untimed_round = True
        scheduled = self.scheduler.schedule()
        events: list[StepEvent] = []
        self.last_round_nodes = None
        round_s = prefill_s = None
        if not scheduled.decode:
            self._ahead = self._chosen_ahead = None  # (for rows that have all finished since)
        else:
            round_s = time.perf_counter()
            rows, result = self._round(scheduled.decode, may_queue_next=not scheduled.prefill)
            round_s = time.perf_counter() - round_s
            for req, tokens, size in zip(rows, result.emitted, result.tree_sizes):
                if req.finished:  # it finished (or was aborted) after the round was queued
                    continue
                req.stats.rounds += 1
                req.stats.acceptance_lengths.append(len(tokens))
                req.stats.tree_sizes.append(size)
                events.append(append_tokens(req, tokens, self.tracker, self.config.max_context))
        if scheduled.prefill:
            prefill_s = time.perf_counter()
            defer = self._prompts_fitting_drafter_lag(scheduled.prefill)
            firsts = self.runner.prefill(scheduled.prefill, self.config.prefill_chunk, defer=defer)
            prefill_s = time.perf_counter() - prefill_s
            for req, first, deferred in zip(scheduled.prefill, firsts, defer):
                if deferred:
                    req.drafter_lag = len(req.prompt_ids)
                req.prefilled = min(len(req.prompt_ids), req.prefilled + self.config.prefill_chunk)
                if first is not None:
                    req.status = Status.RUNNING
                    events.append(append_tokens(req, [first], self.tracker, self.config.max_context))
        released = [req.slot for req in self.scheduler.release_finished()]
        if released:  # (sent without waiting for queued device work: a queued round may still run)
            self.cache.free(to_device(torch.tensor(released), self.device))
            self.proposer.release(released)
        previous_end, self._last_step_end = self._last_step_end, time.perf_counter()
        if self.step_tracer is not None:
            self.step_tracer.write(started=started, ended=self._last_step_end,
                                   previous_end=None if previous_end == float("-inf") else previous_end,
                                   round_s=round_s, rows=len(scheduled.decode), nodes=self.last_round_nodes,
                                   prefill_s=prefill_s, prefill_rows=len(scheduled.prefill))
        return events

    def _round(self, rows: Sequence[Request], may_queue_next: bool) -> tuple[list[Request], RoundResult]:
        """One round with the policy's node count; its wall time (the host sync included) and
        acceptance go back to the policy. Returns the round's rows (a round queued in the last step
        may hold rows that have finished since) and its result. ``may_queue_next``: the next round
        may be queued before this one's results are read (see "Queued plain rounds" above)."""
        queued, self._ahead = self._ahead, None
        if queued is not None and not _serves(queued.rows, rows):
            queued = None  # (not expected: its results are dropped, and the rows run a round as usual)
        if queued is None:
            launched, started, untimed = self._launch_round(rows)
        else:
            launched, started, untimed = queued, max(queued.launched_at, self._last_round_end), False
            self.queued_rounds += 1
        catches_up = False
        if may_queue_next and self._may_queue_after(launched):
            nodes = self._choose_nodes(launched.rows)  # the next round's, made now (see "Queued plain rounds")
            if nodes == 0:
                catches_up = self._lag_full_after(launched.rows)
                self._ahead = self.runner.launch_plain_after(launched, catches_up)
            if self._ahead is None:  # a drafted round, or a graph is not captured yet: the next step runs it
                self._chosen_ahead = nodes
        # the policy folds the rounds it holds while the device runs this one (it waits otherwise)
        meanwhile = self.policy.fold_settled if self.runner.runs_ahead else None
        result = self.runner.finish(launched, meanwhile)
        self._last_round_end = time.perf_counter()
        nodes, rows = launched.nodes, launched.rows
        self._count_deferrals(rows, nodes)
        if catches_up and self._ahead is not None:  # the queued round's catch-up projects them all
            for req in rows:
                req.drafter_lag = 0
        wall = self._last_round_end - started
        seconds = None if result.captured_graph or untimed else wall
        acceptance = mean_acceptance(rows, result, nodes)
        self.policy.record(len(rows), nodes, seconds, acceptance)
        if self.policy_tracer is not None:
            self.policy_tracer.write(len(rows), nodes, seconds, acceptance, self.policy, wall)
        self.rounds_by_nodes[nodes] += 1
        self.last_round_nodes = nodes
        return rows, result

    def _launch_round(self, rows: Sequence[Request]):
        """Choose the round's node count (unless the last step did) and queue it (a drafter
        catch-up first when due); returns the launched round, when it started and whether its wall
        time goes untimed."""
        nodes, self._chosen_ahead = self._chosen_ahead, None
        if nodes is None:
            nodes = self._choose_nodes(rows)
        after_idle, self._untimed_round = self._untimed_round, False
        option = (rows_bucket(len(rows)), nodes)
        first_of_option = option not in self._warmed_options
        self._warmed_options.add(option)
        started = time.perf_counter()
        captured = self._catch_up_drafter(rows, nodes)  # part of the round's cost
        launched = self.runner.launch(rows, nodes)
        return launched, started, captured or after_idle or first_of_option

    def _choose_nodes(self, rows: Sequence[Request]) -> int:
        """The policy's node count for a round of ``rows`` (a neighbour probe the engine declines
        gives the best option instead)."""
        nodes = fit_to_budgets(self.policy.choose(len(rows)), rows, self.policy.ladder)
        if self._probe_declined(rows, nodes):
            nodes = fit_to_budgets(self.policy.best(len(rows)), rows, self.policy.ladder)
        return nodes

    def _may_queue_after(self, launched) -> bool:
        """The next round's node count may be chosen now, before ``launched``'s results are read,
        and the round queued if it is plain: this round is plain, the policy is settled on plain
        rounds (its choice then hardly depends on this round's measurement) and every row has room
        for two more tokens."""
        if not self.queue_plain_rounds or launched.nodes != 0:
            return False
        rows = launched.rows
        settled_plain = getattr(self.policy, "settled_on_plain", None)  # (a policy that cannot tell: never)
        if settled_plain is None or not settled_plain(len(rows)):
            return False
        limit = self.config.max_context - 2
        return all(r.committed_length < limit for r in rows)

    def _lag_full_after(self, rows: Sequence[Request]) -> bool:
        """After this plain round some row's drafter lag is full: the next round catches every
        lagging row up first (as ``_catch_up_drafter`` would)."""
        capacity = getattr(self.proposer, "lag_capacity", None)
        return capacity is not None and any(r.drafter_lag + 1 >= capacity for r in rows)

    def _probe_declined(self, rows: Sequence[Request], nodes: int) -> bool:
        """A neighbour probe's tree round that would capture a graph for an option that cannot
        beat the best one is declined (see "Probes and CUDA graphs" above)."""
        if not nodes or not self.policy.probing or self.runner.has_graph(rows, nodes):
            return False
        if self.policy.worth_a_graph(len(rows), nodes):
            return False
        self.policy.decline_probe()
        return True

    def _prompts_fitting_drafter_lag(self, rows: Sequence[Request]) -> list[bool]:
        """Per row: its whole prompt is in this prefill chunk and fits the drafter's lag. The
        drafter then defers the prompt's features like a plain round's (projected at the row's
        first drafted round, batched), and the first token does not wait for the drafter."""
        capacity = getattr(self.proposer, "lag_capacity", None)
        if capacity is None:
            return [False] * len(rows)
        return [r.prefilled == 0 and len(r.prompt_ids) <= min(capacity, self.config.prefill_chunk) for r in rows]

    def _catch_up_drafter(self, rows: Sequence[Request], nodes: int) -> bool:
        """Before a drafted round, or when a row's lag is full, the drafter projects the context
        features it deferred during plain rounds, for every lagging row at once. (Catching up only
        the full rows cost a round at 32 rows one eager drafter pass every two rounds, since rows
        join at different times; this way the rows fall into step and one pass serves them all
        every ``lag_capacity`` rounds.) Returns whether the catch-up captured a CUDA graph (its
        wall time is then not typical)."""
        capacity = getattr(self.proposer, "lag_capacity", None)
        if capacity is None:
            return False
        if nodes > 0 or any(r.drafter_lag >= capacity for r in rows):
            behind = [r for r in rows if r.drafter_lag]
        else:
            behind = []
        captured = False
        if behind:
            captured = self.runner.catch_up_drafter(behind)
            for req in behind:
                req.drafter_lag = 0
        return captured

    def _count_deferrals(self, rows: Sequence[Request], nodes: int) -> None:
        """A plain round deferred each row's committed token (after the row's lag so far, which
        went into the round's inputs)."""
        if nodes == 0 and hasattr(self.proposer, "lag_capacity"):
            for req in rows:
                req.drafter_lag += 1

    def close_traces(self) -> None:
        """Write out and close the trace files (a server does this when it stops; buffered step
        lines are also written at interpreter exit, which a signal may skip)."""
        for tracer in (self.step_tracer, self.policy_tracer):
            if tracer is not None:
                tracer.close()
        self.step_tracer = self.policy_tracer = None

    def run_until_done(self, requests: list[Request]) -> None:
        while any(not r.finished for r in requests):
            self.step()


# The first round after a pause of this long between engine steps (the engine sat idle: no
# requests) is not timed for the speculation policy: it runs on a cold host and device, and its
# wall time says little about its node count. Steps that follow each other (a long prefill
# included) do not count as a pause.
IDLE_GAP_S = 0.05


def make_policy(config: EngineConfig, proposer) -> SpecPolicy | FixedNodes:
    """The adaptive policy over the proposer's ladder, or every round at ``max_nodes``."""
    if not config.adaptive_spec or proposer.max_nodes == 0:
        return FixedNodes(proposer.max_nodes)
    ladder = node_ladder(proposer.max_nodes, getattr(proposer, "chain", False), config.spec_policy.min_tree_nodes)
    return SpecPolicy(ladder, config.spec_policy)


def _serves(queued_rows: Sequence[Request], rows: Sequence[Request]) -> bool:
    """A round queued for ``queued_rows`` serves the step's ``rows``: they are the queued rows that
    have not finished since, in the same order."""
    live = [r for r in queued_rows if not r.finished]
    return len(live) == len(rows) and all(a is b for a, b in zip(live, rows))


def fit_to_budgets(nodes: int, rows: Sequence[Request], ladder: Sequence[int]) -> int:
    """``nodes``, or the smallest ladder option that still holds every row's own budget when
    all rows asked for less (verifying nodes no row may use is wasted work)."""
    if any(r.budget is None for r in rows):
        return nodes
    wanted = max(r.budget for r in rows)
    if wanted >= nodes:
        return nodes
    return min((n for n in ladder if n >= wanted), default=nodes)


def mean_acceptance(rows: Sequence[Request], result: RoundResult, nodes: int) -> float | None:
    """Mean acceptance length of the rows whose own budget did not cap the round's node count
    (None when every row was capped: the round says little about ``nodes``)."""
    lengths = [len(tokens) for r, tokens in zip(rows, result.emitted) if r.budget is None or r.budget >= nodes]
    return sum(lengths) / len(lengths) if lengths else None
