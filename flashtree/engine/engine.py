"""LLMEngine: load the models, take requests, and advance every active request one step at a time.

``step()`` is the whole loop: schedule -> one round for the running rows -> one prefill chunk for
the admitted rows -> append the committed tokens (stop conditions) -> free finished slots.

A round's node count comes from the speculation policy (``flashtree/policy/``), which gets the
round's wall time and acceptance afterwards. A round's wall time is left out (None) when it says
little about its node count: after an idle pause (``IDLE_GAP_S``), when the round captured a CUDA
graph, and for the first round of a node count at a rows bucket (a warm-up: one slow sample of the
smallest tree would cap every tree's score by the policy's monotone round times).

The CUDA graphs of every round the policy may choose (rows bucket x node count x sampling variant,
up to ``cuda_graph_max_tokens`` tokens a round) are captured at start-up, and none while serving: a
round with no graph (log-probabilities, adjusted logits, a fixed tree past the cap) runs eagerly.
Prefill steps run eagerly; start-up runs throwaway ones first (``engine/warm_up.py``), so that no Triton
kernel compiles while serving either.

With lazy capture (``cuda_graph_max_tokens=None``) a capture costs tens of plain rounds or more,
so a neighbour probe whose round has no captured graph is declined unless its option could beat
the best one (``Policy.worth_a_graph``); the round runs the best option instead, and the policy
waits longer before the next probe.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from flashtree.config import EngineConfig, prefill_tokens_for
from flashtree.device_copy import to_device
from flashtree.engine.constraint import advance_grammar
from flashtree.engine.graphs import GraphCache
from flashtree.engine.memory_profile import ActivationReserve, held_bytes, peak_bytes
from flashtree.engine.output import StepEvent, TextTracker, append_tokens
from flashtree.engine.overlap import QueuedRounds
from flashtree.engine.prefill import FirstToken, Prefill
from flashtree.engine.request import Request, Status
from flashtree.engine.round import RowAllotment
from flashtree.engine.runner import LaunchedRound, ModelRunner, RoundResult, round_span
from flashtree.engine.scheduler import PageBudget, Scheduler
from flashtree.engine.stage_timer import StageTimer
from flashtree.engine.token_state import SlotTokenState
from flashtree.engine.tp_executor import TensorParallelExecutor
from flashtree.engine.traces import PolicyTracer, RecentTrees, StepTracer, TreeTracer
from flashtree.engine.warm_up import warm_up_steps
from flashtree.errors import ConfigError, RequestError
from flashtree.grammar.backends import LazyGrammars
from flashtree.kernels import gpu as gpu_kernels
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.kv.pages import PagePool, PageTable, pages_for
from flashtree.kv.prefix_cache import PrefixCache
from flashtree.models.build import (
    LoadedTarget,
    load_target,
    resolve_device,
    resolve_dtype,
)
from flashtree.models.tokenizer import stop_token_ids_for
from flashtree.policy import make_policy, rows_bucket
from flashtree.policy.memory import PolicyMemory
from flashtree.sampling import SamplingParams
from flashtree.structured import StructuredOutput
from flashtree.speculative.registry import make_proposer

# The first round after a pause of this long between engine steps (the engine sat idle: no
# requests) is not timed for the speculation policy: it runs on a cold host and device. Steps that
# follow each other (a long prefill included) do not count as a pause.
IDLE_GAP_S = 0.05

log = logging.getLogger("flashtree")


class LLMEngine:
    def __init__(self, config: EngineConfig, target: LoadedTarget | None = None):
        """``target``: reuse an already loaded target (built for this config's device and dtype)."""
        self.config = config
        scheduling, kernels = config.scheduler, config.kernels
        self.device = resolve_device(config.target.device)
        self.dtype = resolve_dtype(config.target.dtype, self.device)
        t0 = time.perf_counter()
        self.executor = self._start_executor(target)
        self.model, self.tokenizer = (target or load_target(config, self.device, self.dtype) if self.executor is None
                                      else self.executor.target)
        self.proposer = make_proposer(config, self.model, self.tokenizer)
        self.lag = self.proposer.lag
        self.warm_up_seconds = self._warm_up()  # (before the real pool: its pages are what is left afterwards)
        self.activation_reserve = ActivationReserve(0, 0, 0)  # measured when the pool's size depends on it
        self.pages = self._make_pages()
        self.cache = self._make_cache(self.pages)
        self.proposer.attach_pages(self.pages)
        self.prefix_cache = PrefixCache(self.pages.pool, config.cache.page_size) if config.cache.prefix_caching else None
        self.token_state: SlotTokenState | None = None  # made when a request first adjusts its logits
        self.model.setup_rope(self.cache.spec.capacity + 1)
        self.timer = StageTimer(self.device, kernels.profile_stages)
        tree_tracer = TreeTracer(config.trace.trees) if config.trace.trees else None
        if config.trace.recent_trees:
            tree_tracer = RecentTrees(config.trace.recent_trees, then=tree_tracer)
        if self.executor is not None:  # (a replayed graph would skip the commands to the workers)
            kernels = dataclasses.replace(kernels, cuda_graphs=False)
        self.runner = ModelRunner(self.model, self.cache, self.proposer, self.timer, kernels, tree_tracer,
                                  pad_slot=scheduling.max_running, packed=self._fixed_packed_rounds())
        self.prefill = Prefill(self.model, self.cache, self.proposer, self.timer, planless=kernels.planless_prefill)
        # requests are promised the pages the pad slot left free
        self.scheduler = Scheduler(scheduling, config.cache, PageBudget(
            self.pages.pool.free_pages, config.cache.page_size, self.runner.span),
            device_type=self.device.type)
        graph_tokens = kernels.cuda_graph_max_tokens if self.runner.graphs is not None else None
        self.policy = make_policy(config.speculation, self.proposer.max_nodes, self.proposer.chain, self.device.type,
                                  graph_tokens, PolicyMemory.for_engine(config, self.device, self.dtype),
                                  scheduling.max_round_tokens)
        queue = scheduling.queue_plain_rounds if scheduling.queue_plain_rounds is not None else self.runner.runs_ahead
        self.overlap = QueuedRounds(self.runner, self.lag, config.cache.max_context, enabled=queue)
        self.rounds_by_nodes: Counter[int] = Counter()  # batched rounds per chosen node count
        self.last_round_nodes: int | None = None  # node count of the last step's round (None: no round)
        self._last_step_end = float("-inf")  # perf_counter() when the last step ended
        self._last_round_end = float("-inf")  # perf_counter() when the host last read a round's results
        self._untimed_round = False  # the next round follows an idle pause: not timed for the policy
        self._warmed_options: set[tuple[int, int]] = set()  # (rows bucket, nodes) run at least once
        self.policy_tracer = PolicyTracer(config.trace.policy) if config.trace.policy else None
        self.step_tracer = StepTracer(config.trace.steps) if config.trace.steps else None
        self.tracker = TextTracker(self.tokenizer, scheduling.incremental_text)
        self.default_stop_ids = frozenset(stop_token_ids_for(self.model.config, self.tokenizer))
        self.grammars = LazyGrammars(self.tokenizer, self.model.config.vocab_size, self.default_stop_ids,
                                     config.scheduler.grammar_backend)  # (made for the first structured request)
        self.graph_capture_seconds = self._capture_graphs()
        self._captures_at_start = self.runner.graphs.captures if self.runner.graphs is not None else 0
        self.load_seconds = time.perf_counter() - t0

    def _start_executor(self, target: LoadedTarget | None) -> TensorParallelExecutor | None:
        """With ``tensor_parallel_size`` > 1: the workers, started, and rank 0's shard of the target."""
        if self.config.parallel.tensor_parallel_size == 1:
            return None
        if target is not None:
            raise ConfigError("a loaded target cannot be shared with a tensor-parallel engine: it loads its own shards")
        return TensorParallelExecutor(self.config, self.device, self.dtype)

    def watch_workers(self, on_death) -> None:
        """``on_death(what happened)`` is called once, from another thread, when a worker process of this
        engine exits (tensor parallelism; nothing to watch otherwise): the engine cannot go on."""
        if self.executor is not None:
            self.executor.watch(on_death)

    def close(self) -> None:
        """Stop the engine's worker processes, if any (idempotent); it runs nothing afterwards."""
        if self.executor is not None:
            self.executor.close()

    @property
    def graph_counts(self) -> tuple[int, int]:
        """(CUDA graphs captured since start-up, rounds run eagerly for want of one)."""
        graphs = self.runner.graphs
        return (0, 0) if graphs is None else (graphs.captures - self._captures_at_start, graphs.eager_runs)

    @property
    def graph_replays(self) -> tuple[int, float]:
        """(CUDA graphs replayed, host seconds their replay() calls took: the launches) since the engine began."""
        graphs = self.runner.graphs
        return (0, 0.0) if graphs is None else (graphs.replays, graphs.replay_host_seconds)

    def _capture_graphs(self) -> float:
        """With CUDA graphs and ``cuda_graph_max_tokens``: capture now every round graph the engine
        may need (``ModelRunner.graph_keys``), with a progress bar, so that none is captured while
        serving; returns the seconds it took."""
        max_tokens = self.config.kernels.cuda_graph_max_tokens
        if self.runner.graphs is None or max_tokens is None:
            return 0.0
        scheduling = self.config.scheduler
        keys = self.runner.graph_keys(self.policy.ladder, scheduling.max_running, max_tokens, scheduling.max_round_tokens)
        if not keys:
            return 0.0
        t0 = time.perf_counter()
        self.runner.capture_graphs(tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False))
        seconds = time.perf_counter() - t0
        log.info("flashtree: captured %d CUDA graphs in %.1f s", len(keys), seconds)
        return seconds

    def _make_pages(self, requests: int | None = None) -> PageTable:
        """The block tables of the target's and the drafter's caches: a slot per running request
        and the pad slot (mapped now: it holds a round's scratch), and a pool of ``requests`` pages
        for the requests (default: ``kv_pages``, or what ``gpu_memory_utilization`` leaves, or every
        running request can reach max_context), the pad slot's and the null page."""
        proposer, cache, scheduling = self.proposer, self.config.cache, self.config.scheduler
        span = round_span(proposer)
        widest = max(scheduling.prefill_chunk, proposer.max_nodes + 1, proposer.max_depth + 1, proposer.lag.capacity)
        per_request = pages_for(cache.max_context + span, cache.page_size)
        if requests is None:
            requests = cache.kv_pages or self._pages_in_memory() or scheduling.max_running * per_request
        pool = PagePool(1 + pages_for(span, cache.page_size) + requests)
        table = PageTable if self.executor is None else self.executor.page_table  # (its writes reach the workers)
        pages = table(pool, scheduling.max_running + 1, cache.max_context + widest, cache.page_size, self.device)
        pages.ensure([scheduling.max_running], [span])
        return pages

    def _pages_in_memory(self) -> int | None:
        """With ``gpu_memory_utilization`` on CUDA: the pages (target and drafter entries) that bring
        the device's memory in use to that fraction of its total; else None."""
        utilization = self.config.cache.gpu_memory_utilization
        if utilization is None or self.device.type != "cuda":
            return None
        cfg, page_size = self.model.config, self.config.cache.page_size
        entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * self.model.lm_head.weight.element_size()
        if self.executor is None:  # (tensor-parallel rounds run on the workers too: not profiled)
            self.activation_reserve = self.measure_activation_reserve(peak_bytes)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        spare = utilization * total - (total - free) - self.activation_reserve.bytes
        pages = int(spare // ((entry + self.proposer.context_entry_bytes()) * page_size))
        log.info("flashtree: %d KV pages; reserved %.2f GiB for activations %s", pages,
                 self.activation_reserve.bytes / 2**30, self.activation_reserve)
        if pages < 1:
            raise ConfigError(f"--gpu-memory-utilization {utilization} leaves no room for KV pages: "
                              f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use already and the "
                              f"widest rounds and prefill steps need {self.activation_reserve.bytes / 2**30:.1f} GiB more")
        return pages

    def measure_activation_reserve(self, peak: Callable[[torch.device, Callable[[], object]], int]
                                   ) -> ActivationReserve:
        """The memory of the engine's widest work (``engine/memory_profile.py``) on pad rows of a provisional
        cache that holds only the pad slot: start-up's graphs captured and dropped (``held_bytes``), the
        widest round (twice in a row) and prefill step each run with ``peak(device, run)`` measured; the
        proposer's context cache is left on the provisional pages (attach it to the real ones)."""
        config, chunk = self.config, self._longest_prefill_chunk()
        prefill = self._provisional_prefill(chunk)
        runner = ModelRunner(self.model, prefill.cache, self.proposer, prefill.timer, config.kernels,
                             pad_slot=config.scheduler.max_running, packed=self._fixed_packed_rounds())
        captured, widest = self._profiled_rounds(runner)
        prompts = self._pad_prefill_rows(max(1, prefill_tokens_for(self.config.scheduler, self.device.type) // chunk),
                                         chunk)
        try:
            pool, launch_data = (held_bytes(self.device, lambda: _capture_and_take(runner, captured)) if captured
                                 else (0, 0))
            return ActivationReserve(
                graphed_round=pool, graph_memory=launch_data,
                widest_round=max(peak(self.device, lambda k=key: (runner.run_on_pad_rows(k), runner.run_on_pad_rows(k)))
                                 for key in widest),
                prefill=peak(self.device, lambda: prefill(prompts, chunk)))
        except torch.cuda.OutOfMemoryError:
            width, shape = widest[0]
            raise ConfigError(
                f"the engine's widest work does not fit the device's memory beside the weights: a round of {width} rows "
                f"x {shape.nodes + 1} tokens or a prefill step of {len(prompts)} x {chunk} tokens; lower --max-running, "
                f"--budget or --max-prefill-tokens (or keep --adaptive-spec on)") from None

    def _profiled_rounds(self, runner: ModelRunner) -> tuple[list[tuple], list[tuple]]:
        """(the graph keys the reserve captures: every graph start-up captures, in its order, or where graphs are
        captured while serving, the widest round's variants a graph may hold; the widest round's keys in each
        sampling variant, whose eager peak the reserve measures)."""
        config, max_rows = self.config, self.config.scheduler.max_running
        graph_tokens = config.kernels.cuda_graph_max_tokens if runner.graphs is not None else None
        round_tokens = config.scheduler.max_round_tokens
        policy = make_policy(config.speculation, self.proposer.max_nodes, self.proposer.chain, self.device.type,
                             graph_tokens, max_round_tokens=round_tokens)
        widest = runner.round_variants(*policy.widest_round(max_rows))
        if graph_tokens is not None:  # captured at start-up: up to graph_tokens verified tokens
            return runner.graph_keys(policy.ladder, max_rows, graph_tokens, round_tokens), widest
        # captured while serving (or no graphs): any round but one with log-probabilities
        return ([key for key in widest if key[1].logprobs is None] if runner.graphs is not None else []), widest

    def _longest_prefill_chunk(self) -> int:
        """The most prompt tokens a row brings to one prefill step."""
        scheduling = self.config.scheduler
        return min(scheduling.prefill_chunk, prefill_tokens_for(scheduling, self.device.type))

    def _provisional_prefill(self, chunk: int) -> Prefill:
        """A prefill on a provisional cache whose pool holds only the pad slot's pages and ``chunk`` prompt
        tokens more, for the work start-up runs before it sizes the real pool (the memory profile, the warm-up);
        the proposer's context cache is left on the provisional pages (attach it to the real ones)."""
        kernels = self.config.kernels
        pages = self._make_pages(requests=pages_for(chunk, self.config.cache.page_size))
        cache = self._make_cache(pages)
        self.proposer.attach_pages(pages)
        self.model.setup_rope(cache.spec.capacity + 1)
        timer = StageTimer(self.device, kernels.profile_stages)
        return Prefill(self.model, cache, self.proposer, timer, planless=kernels.planless_prefill)

    def _pad_prefill_rows(self, rows: int, width: int) -> list[Request]:
        """``rows`` prompts of ``width`` tokens, all on the pad slot: a throwaway prefill step."""
        pad = self.config.scheduler.max_running
        return [Request(prompt_ids=[0] * width, params=SamplingParams(max_tokens=1), stop_token_ids=frozenset(),
                        slot=pad) for _ in range(rows)]

    def _warm_up(self) -> float:
        """Run the warm-up prefill steps (``engine/warm_up.py``) when ``KernelConfig.warm_up`` asks (None: on
        CUDA; not with tensor-parallel workers, whose forwards run on their own); returns the seconds it took."""
        wanted = self.config.kernels.warm_up
        if not (wanted if wanted is not None else self.device.type == "cuda") or self.executor is not None:
            return 0.0
        t0 = time.perf_counter()
        chunk = self._longest_prefill_chunk()
        steps = warm_up_steps(chunk, self.config.scheduler.max_running,
                              prefill_tokens_for(self.config.scheduler, self.device.type))
        prefill = self._provisional_prefill(chunk)
        for width, rows in tqdm(steps, desc="warming up prefill kernels", unit="step", leave=False):
            prefill(self._pad_prefill_rows(rows, width), width)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - t0
        log.info("flashtree: warmed up %d prefill shapes in %.1f s", len(steps), seconds)
        return seconds

    def _make_cache(self, pages: PageTable) -> KVCache:
        """The target's KV cache: a slot per running request and the pad slot, each with room for the
        context and the widest forward (a tree or a prefill chunk), on ``pages``."""
        cfg, config = self.model.config, self.config
        scratch = max(self.proposer.max_nodes + 1, config.scheduler.prefill_chunk)
        spec = KVCacheSpec(cfg.num_hidden_layers, config.scheduler.max_running + 1, config.cache.max_context,
                           scratch, cfg.num_key_value_heads, cfg.head_dim, config.cache.page_size)
        if self.executor is None:
            cache = KVCache(spec, self.dtype, self.device, pages)
        else:  # each rank's cache holds its KV heads (the shard's config); commits run on every rank
            cache = self.executor.make_cache(spec, self.dtype)
        cache.commit_kernel = (config.kernels.gpu_kernels and config.kernels.triton_tree
                               and gpu_kernels.usable_on(cache.storage))
        return cache

    @property
    def queued_rounds(self) -> int:
        """Rounds that were queued before the round ahead of them was read."""
        return self.overlap.taken

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, budget: int | None = None,
                    after: Request | None = None) -> Request:
        """Queue a request. ``after``: a request with the same prompt (n > 1); with prefix caching on,
        this one is admitted once that one's prompt is in, and maps its pages."""
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is out of range; allowed: integers in [0, {vocab})")
        params = params.with_seed()
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.default_stop_ids))
        req = Request(prompt_ids=list(prompt_ids), params=params, stop_token_ids=frozenset(stop_ids), budget=budget,
                      after=after if self.prefix_cache is not None else None)
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured)
        self.scheduler.add(req)
        if params.adjusts and self.token_state is None:
            self.token_state = SlotTokenState(self.config.scheduler.max_running + 1, vocab, self.config.cache.max_context,
                                              self.device)
            self.runner.round_program.token_state = self.prefill.token_state = self.token_state
        return req

    def compile_structured(self, structured: StructuredOutput) -> None:
        """Compile ``structured`` now (any thread: a server compiles off its engine thread, whose
        request then finds it compiled); a RequestError names what does not compile."""
        self.grammars.matcher(structured)

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
        admitted = self.scheduler.admit()
        if admitted:
            self._admitted(admitted)
        scheduled = self.scheduler.plan()
        events: list[StepEvent] = []
        self.last_round_nodes = None
        round_s = prefill_s = None
        if not scheduled.decode:
            self.overlap.clear()
        else:
            round_s = time.perf_counter()
            launched, result = self._round(scheduled.decode, may_queue_next=not scheduled.prefill)
            round_s = time.perf_counter() - round_s
            events += self._append_round(launched, result)
        if scheduled.prefill:
            prefill_s = time.perf_counter()
            defer = self.lag.prompts_to_defer(scheduled.prefill, self.config.scheduler.prefill_chunk)
            firsts = self.prefill(scheduled.prefill, self.config.scheduler.prefill_chunk, defer=defer)
            prefill_s = time.perf_counter() - prefill_s
            events += self._start_running(scheduled.prefill, firsts, defer)
        released = [req.slot for req in self.scheduler.release_finished()]
        if released:  # (sent without waiting for queued device work: a queued round may still run, and
            # work queued later, which may reuse the pages, runs after it)
            self.cache.free(to_device(torch.tensor(released), self.device))
            self.proposer.release(released)
            self.pages.release(released)
        previous_end, self._last_step_end = self._last_step_end, time.perf_counter()
        if self.step_tracer is not None:
            self.step_tracer.write(started=started, ended=self._last_step_end,
                                   previous_end=None if previous_end == float("-inf") else previous_end,
                                   round_s=round_s, rows=len(scheduled.decode), nodes=self.last_round_nodes,
                                   prefill_s=prefill_s, prefill_rows=len(scheduled.prefill))
        return events

    def _round(self, rows: Sequence[Request], may_queue_next: bool) -> tuple[LaunchedRound, RoundResult]:
        """One round for the running rows (queued in the last step, or launched now); the next plain
        round may be queued while the host reads this one (``overlap.py``). A round queued in the last
        step may hold rows that have finished since."""
        launched, started, untimed = self._take_or_launch(rows)
        catches_up = may_queue_next and self.overlap.queue_after(launched, self.policy, self._choose_nodes)
        # the policy folds the rounds it holds while the device runs this one (it waits otherwise)
        meanwhile = self.policy.fold_settled if self.runner.runs_ahead else None
        result = self.runner.finish(launched, meanwhile)
        self._last_round_end = time.perf_counter()
        self.lag.after_round(launched.rows, launched.nodes)
        if catches_up:  # the queued round's catch-up projects them all
            self._caught_up(launched.rows)
        wall = self._last_round_end - started
        # (an eager round with grammar work says little about the graphed rounds the policy weighs)
        untimed = untimed or result.captured_graph or (launched.constrained and self.runner.graphs is not None)
        self._record(launched, result, None if untimed else wall, wall)
        return launched, result

    def _append_round(self, launched: LaunchedRound, result: RoundResult) -> list[StepEvent]:
        """Each row's committed tokens appended (stop conditions) and counted."""
        events = []
        logprobs = result.logprobs or [None] * len(launched.rows)
        for req, tokens, size, row_logprobs in zip(launched.rows, result.emitted, result.tree_sizes, logprobs):
            if req.finished:  # it finished (or was aborted) after the round was queued
                continue
            req.stats.rounds += 1
            req.stats.acceptance_lengths.append(len(tokens))
            req.stats.tree_sizes.append(size)
            events.append(self._append(req, tokens, row_logprobs))
        return events

    def _append(self, req: Request, tokens: list[int], logprobs) -> StepEvent:
        """``tokens`` appended to ``req`` (stop conditions); a grammar that terminates ends the request ("stop",
        by its last token), one that refuses a token ends it too ("abort")."""
        accepted = advance_grammar(req, tokens)
        completed = req.grammar is not None and req.grammar.terminated
        event = append_tokens(req, accepted, self.tracker, self.config.cache.max_context, logprobs,
                              stop_at_last=completed)
        if len(accepted) < len(tokens) and not req.finished:
            req.finish_reason, req.status = "abort", Status.FINISHED
            event = event._replace(finished=True)
        return event

    def _take_or_launch(self, rows: Sequence[Request]) -> tuple[LaunchedRound, float, bool]:
        """The round queued for ``rows`` in the last step, or a new one with the policy's node count
        (a drafter catch-up first when due); with when it started and whether it goes untimed."""
        queued = self.overlap.take(rows)
        if queued is not None:
            return queued, max(queued.launched_at, self._last_round_end), False
        nodes = self.overlap.take_chosen()
        if nodes is None:
            nodes = self._choose_nodes(rows)
        after_idle, self._untimed_round = self._untimed_round, False
        option = (rows_bucket(len(rows)), nodes)
        first_of_option = option not in self._warmed_options
        self._warmed_options.add(option)
        started = time.perf_counter()
        captured = self._catch_up_drafter(rows, nodes)  # part of the round's cost
        launched = self.runner.launch(rows, nodes, self._allotment(rows, nodes))
        return launched, started, captured or after_idle or first_of_option

    def _allotment(self, rows: Sequence[Request], nodes: int) -> RowAllotment | None:
        """Per-row budgets from each row's own tree for a drafted tree round, by the policy's cost curve;
        None: every row keeps ``nodes`` (or the runner's fixed packed rounds allot them, ``packed_verify=True``).
        On a CPU only, where the host knows the rows' counts without a sync: the verify forward runs their
        tokens packed (``packed_verify`` None; a tensor-parallel forward stays padded) or narrowed to the widest
        row (False)."""
        packed = self.config.kernels.packed_verify
        if nodes == 0 or self.proposer.chain or self.device.type != "cpu" or self.runner.packed:
            return None
        costs = self.policy.round_costs(len(rows), nodes)
        if costs is None:
            return None
        padded = packed is False or self.config.parallel.tensor_parallel_size > 1
        return RowAllotment(torch.tensor(costs, device=self.device), padded=padded)

    def _fixed_packed_rounds(self) -> bool:
        """Drafted tree rounds of a fixed packed size (``packed_verify=True``; see ``ModelRunner._packed``)."""
        return self.config.kernels.packed_verify is True and self.config.parallel.tensor_parallel_size == 1

    def _record(self, launched: LaunchedRound, result: RoundResult, seconds: float | None, wall: float) -> None:
        """The round's measurement to the policy (``seconds`` None: untimed) and the traces."""
        rows, nodes = launched.rows, launched.nodes
        acceptance = mean_acceptance(rows, result, nodes)
        self.policy.record(len(rows), nodes, seconds, acceptance)
        if nodes and seconds is not None:  # the cost of the entries per row it verified (per-row budgets)
            self.policy.record_width(len(rows), verified_width(result.tree_sizes, launched.ragged), seconds)
        if self.policy_tracer is not None:
            self.policy_tracer.write(len(rows), nodes, seconds, acceptance, self.policy, wall)
        self.rounds_by_nodes[nodes] += 1
        self.last_round_nodes = nodes

    def _choose_nodes(self, rows: Sequence[Request]) -> int:
        """The policy's node count for a round of ``rows`` (a neighbour probe the engine declines
        gives the best option instead)."""
        nodes = fit_to_budgets(self.policy.choose(len(rows)), rows, self.policy.ladder)
        if self._probe_declined(rows, nodes):
            nodes = fit_to_budgets(self.policy.best(len(rows)), rows, self.policy.ladder)
        return nodes

    def _probe_declined(self, rows: Sequence[Request], nodes: int) -> bool:
        """A neighbour probe's tree round that would capture a graph for an option that cannot
        beat the best one is declined (see the module docstring)."""
        if not nodes or not self.policy.probing or self.runner.has_graph(rows, nodes):
            return False
        if self.policy.worth_a_graph(len(rows), nodes):
            return False
        self.policy.decline_probe()
        return True

    def _catch_up_drafter(self, rows: Sequence[Request], nodes: int) -> bool:
        """Before a drafted round, or when a row's lag is full, the drafter projects the features it
        deferred, for every lagging row at once. Returns whether that captured a CUDA graph."""
        behind = self.lag.due(rows, nodes)
        if not behind:
            return False
        captured = self.runner.catch_up_drafter(behind)
        self._caught_up(behind)
        return captured

    def _admitted(self, rows: list[Request]) -> None:
        """Requests that just got a slot: their logit-adjustment state, and their cached prefix."""
        if self.token_state is not None:
            self.token_state.start(rows)
        self._reuse_prefixes(rows)

    def _reuse_prefixes(self, rows: Sequence[Request]) -> None:
        """Requests that just got a slot (``rows``) map the cached pages of their prompt's longest
        cached prefix and start after it (``kv/prefix_cache.py``)."""
        if self.prefix_cache is None:
            return
        hits, mappings = [], []
        for req in rows:
            pages = self.prefix_cache.match(req.prompt_ids)
            if pages:
                mappings.append((req.slot, pages))
                req.prefilled = req.cached_tokens = len(pages) * self.pages.page_size
                hits.append(req)
        if hits:
            self.pages.share_many(mappings)
            host = torch.tensor([[r.slot for r in hits], [r.prefilled for r in hits]])  # [2, R]
            slots, lengths = to_device(host, self.device).unbind(0)
            self.cache.lengths[slots] = lengths

    def _register_prefixes(self, rows: Sequence[Request], deferred: Sequence[bool]) -> None:
        """The prompt pages a prefill chunk completed become findable; for rows whose drafter deferred
        the prompt (its context K/V are not written yet), at their next catch-up (:meth:`_caught_up`)."""
        if self.prefix_cache is None:
            return
        for req, was_deferred in zip(rows, deferred):
            if was_deferred:
                req.prompt_unregistered = True
            else:
                self.prefix_cache.register(req.prompt_ids, req.prefilled, self.pages.pages_of(req.slot))

    def _caught_up(self, rows: Sequence[Request]) -> None:
        """The drafter has projected (or a queued catch-up will project, before any later round) every
        deferred feature of ``rows``: deferred prompts' pages become findable."""
        self.lag.caught_up(rows)
        for req in rows:
            if req.prompt_unregistered:
                req.prompt_unregistered = False
                self.prefix_cache.register(req.prompt_ids, len(req.prompt_ids), self.pages.pages_of(req.slot))

    def _start_running(self, rows: Sequence[Request], firsts: Sequence[FirstToken | None], deferred: Sequence[bool]
                       ) -> list[StepEvent]:
        """After a prefill chunk: rows whose prompt is complete start running with their first token."""
        self.lag.prompts_deferred(rows, deferred)
        events = []
        for req in rows:
            req.prefilled = min(len(req.prompt_ids), req.prefilled + self.config.scheduler.prefill_chunk)
        self._register_prefixes(rows, deferred)
        for req, first in zip(rows, firsts):
            if first is not None:
                req.status = Status.RUNNING
                logprobs = None if first.logprob is None else [first.logprob]
                events.append(self._append(req, [first.token], logprobs))
        return events

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


def verified_width(tree_sizes: Sequence[int], packed: bool) -> int:
    """Entries per row a drafted round verified, for its cost curve: the widest row's tree and root (padded),
    or the rows' total spread over them, rounded up (packed)."""
    if packed:
        return -(-(sum(tree_sizes) + len(tree_sizes)) // max(len(tree_sizes), 1))
    return max(tree_sizes, default=0) + 1


def _capture_and_take(runner: ModelRunner, keys: list[tuple]) -> GraphCache:
    """The graphs of ``keys`` captured on ``runner``, taken from it (the runner keeps no graph cache)."""
    runner.capture_graphs(keys)
    graphs, runner.graphs = runner.graphs, None
    return graphs
