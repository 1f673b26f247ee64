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
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32))


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
        self.time_to_first_token = Histogram("flashtree_time_to_first_token_seconds",
                                             "Arrival to first generated token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram("flashtree_inter_token_latency_seconds",
                                             "Time per generated token after the first",
                                             buckets=LATENCY_BUCKETS, registry=r)
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
        self.acceptance_length = Histogram("flashtree_spec_acceptance_length",
                                           "Tokens committed per round, bonus included",
                                           buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.round_nodes = Counter("flashtree_spec_batch_rounds",
                                   "Batched rounds (engine steps) by drafted nodes per row; 0 = plain",
                                   ["nodes"], registry=r)
        self.graph_captures = Gauge("flashtree_cuda_graph_captures_after_start",
                                    "CUDA graphs captured while serving (0: all at start-up)", registry=r)
        self.eager_rounds = Gauge("flashtree_cuda_graph_eager_rounds",
                                  "Rounds run eagerly for want of a CUDA graph captured at start-up", registry=r)
        self.engine_info = Gauge("flashtree_engine_info", "The served model and decoding method (value 1)",
                                 ["model", "method", "device", "dtype"], registry=r)

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

    def set_load(self, *, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def set_prefix_cache(self, cache) -> None:
        """From a :class:`~flashtree.kv.prefix_cache.PrefixCache`'s counters."""
        self.prefix_queried.set(cache.queried_tokens)
        self.prefix_hits.set(cache.hit_tokens)
        self.prefix_hit_rate.set(cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0)
        self.prefix_pages.set(cache.cached_pages)

    def set_graphs(self, captures_after_start: int, eager_rounds: int) -> None:
        self.graph_captures.set(captures_after_start)
        self.eager_rounds.set(eager_rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
