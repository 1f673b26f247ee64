"""CountedHistogram: a Prometheus histogram counted in plain Python, for values observed per token.

prometheus_client's ``Histogram.observe`` takes a lock for the sum and another for the bucket
(about 4 us a call on a 2-core EPYC); the engine's side observes one or two values per generated
token, so at 64 rows that was a few tenths of a millisecond of every step. Here an observation is
one bisection and two additions, and ``count`` equal observations share the bisection. Only one thread
observes (the engine's side); a scrape reads the lists as they are, and the library's own exposition
(a custom collector yielding a :class:`HistogramMetricFamily`) writes them out as a histogram.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class CountedHistogram(Collector):
    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)  # upper bounds ("le"), ascending
        self.counts = [0] * len(self.bounds)  # observations per bucket, not cumulative
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        for _ in range(count):  # (one addition each: the sum prometheus_client's Histogram would write)
            self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = itertools.accumulate(self.counts)
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)
