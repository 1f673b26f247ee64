"""Prometheus metrics of one server, in a registry of its own (several servers per process work).

Request flow: ``flashtree_requests_total{endpoint,status}`` (HTTP status per generation
endpoint), ``flashtree_requests_finished_total{finish_reason}`` (stop, length, abort, error).
Tokens: prompt and generation counters; latency: time to first token (arrival -> first
token) and inter-token latency (per token; a round that commits k tokens counts k tokens of
1/k of its interval). Load: running and waiting requests, KV usage (KV pages in use over the pool's);
prefix cache: prompt tokens looked up and served from cached pages (their ratio is the hit rate),
pages it holds. Speculation: rounds, drafted tokens (tree nodes verified),
accepted tokens (drafts committed, bonus excluded), acceptance length per round (bonus included),
and ``flashtree_spec_batch_rounds_total{nodes}``: batched rounds (engine steps) by the drafted
node count per row the engine chose (0 = plain rounds; what adaptive speculation did).

Data-parallel replicas (``server/replicas.py``): the gauges above are sums over the replicas (KV usage:
pages in use over pages, over all of them), and ``flashtree_replica_*{replica}`` give each replica's
running and waiting requests, KV usage, prefix-cache hit tokens and generated tokens, and
``flashtree_replica_routed_requests_total{replica,reason}`` the router's choices (affinity: the replica
holding the prompt's prefix; least_loaded). One engine is replica 0.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from flashtree.server.histogram import CountedHistogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32))


@dataclasses.dataclass
class StepFigures:
    """What one engine step adds to the metrics, gathered over its requests."""

    round_nodes: int | None = None  # the step's drafted nodes per row (None: no round)
    generated: int = 0  # tokens
    first_token_s: list[float] = dataclasses.field(default_factory=list)  # arrival -> first token, per request
    inter_token: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (seconds per token, tokens)
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)  # one per round
    tree_sizes: list[int] = dataclasses.field(default_factory=list)  # one per round
    finished: list[str] = dataclasses.field(default_factory=list)  # finish reasons of the requests that ended


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flashtree_requests", "Generation requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("flashtree_requests_finished", "Admitted requests by how they ended",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("flashtree_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("flashtree_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = CountedHistogram("flashtree_time_to_first_token_seconds",
                                                    "Arrival to first generated token", LATENCY_BUCKETS, r)
        self.inter_token_latency = CountedHistogram("flashtree_inter_token_latency_seconds",
                                                    "Time per generated token after the first", LATENCY_BUCKETS, r)
        self.running = Gauge("flashtree_requests_running", "Requests holding a slot (prefilling or decoding)",
                             registry=r)
        self.waiting = Gauge("flashtree_requests_waiting", "Requests waiting for a slot", registry=r)
        self.kv_usage = Gauge("flashtree_kv_cache_usage_ratio", "KV pages in use over the pool's pages", registry=r)
        self.prefix_queried = Gauge("flashtree_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                    registry=r)
        self.prefix_hits = Gauge("flashtree_prefix_cache_hit_tokens", "Prompt tokens served from cached KV pages",
                                 registry=r)
        self.prefix_hit_rate = Gauge("flashtree_prefix_cache_hit_rate", "Prefix cache hit tokens over queried tokens",
                                     registry=r)
        self.prefix_pages = Gauge("flashtree_prefix_cache_pages", "KV pages the prefix cache holds", registry=r)
        self.spec_rounds = Counter("flashtree_spec_rounds", "Verification rounds (one per request per step)",
                                   registry=r)
        self.drafted_tokens = Counter("flashtree_spec_drafted_tokens", "Drafted tokens (tree nodes) verified",
                                      registry=r)
        self.accepted_tokens = Counter("flashtree_spec_accepted_tokens", "Drafted tokens accepted",
                                       registry=r)
        self.acceptance_length = CountedHistogram("flashtree_spec_acceptance_length",
                                                  "Tokens committed per round, bonus included", ACCEPTANCE_BUCKETS, r)
        self.round_nodes = Counter("flashtree_spec_batch_rounds",
                                   "Batched rounds (engine steps) by drafted nodes per row; 0 = plain",
                                   ["nodes"], registry=r)
        self.graph_captures = Gauge("flashtree_cuda_graph_captures_after_start",
                                    "CUDA graphs captured while serving (0: all at start-up)", registry=r)
        self.eager_rounds = Gauge("flashtree_cuda_graph_eager_rounds",
                                  "Rounds run eagerly for want of a CUDA graph captured at start-up", registry=r)
        self.replica_running = Gauge("flashtree_replica_requests_running", "Requests holding a slot, per replica",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("flashtree_replica_requests_waiting", "Requests waiting for a slot, per replica",
                                     ["replica"], registry=r)
        self.replica_kv_usage = Gauge("flashtree_replica_kv_cache_usage_ratio", "KV pages in use over the pool's, "
                                      "per replica", ["replica"], registry=r)
        self.replica_prefix_hits = Gauge("flashtree_replica_prefix_cache_hit_tokens",
                                         "Prompt tokens served from cached KV pages, per replica", ["replica"],
                                         registry=r)
        self.replica_generation_tokens = Counter("flashtree_replica_generation_tokens", "Tokens generated, per replica",
                                                 ["replica"], registry=r)
        self.routed = Counter("flashtree_replica_routed_requests", "Requests the router sent to each replica, by why",
                              ["replica", "reason"], registry=r)
        self._replicas: dict[int, dict[str, float]] = {}  # replica -> its last load, cache and graph figures
        self._replicas_lock = threading.Lock()  # (each replica's engine thread updates them)
        self.engine_info = Gauge("flashtree_engine_info", "The served model and decoding method (value 1)",
                                 ["model", "method", "device", "dtype"], registry=r)

    def set_engine_info(self, model: str, method: str, device: str, dtype: str) -> None:
        self.engine_info.labels(model=model, method=method, device=device, dtype=dtype).set(1)

    def count_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def count_finished(self, finish_reason: str) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()

    def observe_step(self, step: StepFigures, replica: int = 0) -> None:
        """What one engine step added (one call per step: it runs on the engine's side)."""
        self.observe_round_nodes(step.round_nodes)
        if step.generated:
            self.count_generated(step.generated, replica)
        for seconds in step.first_token_s:
            self.time_to_first_token.observe(seconds)
        for seconds_per_token, tokens in step.inter_token:
            self.inter_token_latency.observe(seconds_per_token, tokens)
        self.observe_rounds(step.acceptance_lengths, step.tree_sizes)
        for finish_reason in step.finished:
            self.count_finished(finish_reason)

    def observe_rounds(self, acceptance_lengths: Sequence[int], tree_sizes: Sequence[int]) -> None:
        if not acceptance_lengths:
            return
        self.spec_rounds.inc(len(acceptance_lengths))
        self.drafted_tokens.inc(sum(tree_sizes))
        self.accepted_tokens.inc(sum(length - 1 for length in acceptance_lengths))
        for length in acceptance_lengths:
            self.acceptance_length.observe(length)

    def observe_round_nodes(self, nodes: int | None) -> None:
        """The node count of one engine step's round (None: the step ran no round)."""
        if nodes is not None:
            self.round_nodes.labels(nodes=str(nodes)).inc()

    def count_generated(self, tokens: int, replica: int = 0) -> None:
        self.generation_tokens.inc(tokens)
        self.replica_generation_tokens.labels(replica=str(replica)).inc(tokens)

    def observe_route(self, replica: int, reason: str) -> None:
        self.routed.labels(replica=str(replica), reason=reason).inc()

    def set_load(self, *, running: int, waiting: int, used_pages: int, pages: int, replica: int = 0) -> None:
        label = str(replica)
        self.replica_running.labels(replica=label).set(running)
        self.replica_waiting.labels(replica=label).set(waiting)
        self.replica_kv_usage.labels(replica=label).set(used_pages / pages)
        totals = self._update(replica, running=running, waiting=waiting, used_pages=used_pages, pages=pages)
        self.running.set(totals["running"])
        self.waiting.set(totals["waiting"])
        self.kv_usage.set(totals["used_pages"] / totals["pages"])

    def set_prefix_cache(self, *, queried_tokens: int, hit_tokens: int, cached_pages: int, replica: int = 0) -> None:
        """A :class:`~flashtree.kv.prefix_cache.PrefixCache`'s counters."""
        self.replica_prefix_hits.labels(replica=str(replica)).set(hit_tokens)
        totals = self._update(replica, queried=queried_tokens, hits=hit_tokens, cached_pages=cached_pages)
        self.prefix_queried.set(totals["queried"])
        self.prefix_hits.set(totals["hits"])
        self.prefix_hit_rate.set(totals["hits"] / totals["queried"] if totals["queried"] else 0.0)
        self.prefix_pages.set(totals["cached_pages"])

    def set_graphs(self, captures_after_start: int, eager_rounds: int, replica: int = 0) -> None:
        totals = self._update(replica, captures=captures_after_start, eager=eager_rounds)
        self.graph_captures.set(totals["captures"])
        self.eager_rounds.set(totals["eager"])

    def _update(self, replica: int, **figures: float) -> dict[str, float]:
        """Record ``replica``'s latest ``figures``; returns each figure's sum over the replicas."""
        with self._replicas_lock:
            self._replicas.setdefault(replica, {}).update(figures)
            return {name: sum(r.get(name, 0) for r in self._replicas.values()) for name in figures}

    def render(self) -> bytes:
        return generate_latest(self.registry)
