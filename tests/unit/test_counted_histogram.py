"""CountedHistogram writes out exactly what prometheus_client's own Histogram writes for the same
observations (bucket edges included, and ``count`` equal observations as that many)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from flashtree.server.histogram import CountedHistogram
from flashtree.server.metrics import ACCEPTANCE_BUCKETS, LATENCY_BUCKETS


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("seed", range(4))
def test_the_same_exposition_as_prometheus_histogram(seed):
    rng = random.Random(seed)
    for buckets in (LATENCY_BUCKETS, ACCEPTANCE_BUCKETS):
        theirs, ours = CollectorRegistry(), CollectorRegistry()
        reference = Histogram("h", "a histogram", buckets=buckets, registry=theirs)
        counted = CountedHistogram("h", "a histogram", buckets, ours)
        values = [rng.choice(buckets) for _ in range(50)]  # on the edges ("le" includes them)
        values += [rng.uniform(0, buckets[-1] * 1.5) for _ in range(200)] + [0.0, 1e9]
        observed = 0
        for value in values:
            count = rng.choice((1, 1, 3))
            observed += count
            counted.observe(value, count)
            for _ in range(count):
                reference.observe(value)
        assert exposition(ours) == exposition(theirs)
        assert counted.count == observed
