"""What an adaptive policy has learned, in a form another process can start from (``memory.py``
keeps it on disk between processes).

- acceptance: per drafted option, its mean acceptance length (bonus included) and the samples
  behind it; shared by every rows bucket, as in the policy's estimates.
- relative seconds: per rows bucket and drafted option, its round time over a plain round's time
  in the same bucket, and the timed rounds behind it. Relative, because the machine's pace moves
  between processes (other load, clock frequency) while the options' costs against each other
  hardly do: a fresh process times its own plain rounds and scales these by them.
- probe schedule: per rows bucket, the rounds between neighbour probes (after any backing off) and
  the rounds left before the next one, so that a run of short processes probes as one long one
  would instead of once each.
"""

from __future__ import annotations

import dataclasses
import math

from flashtree.policy.base import PLAIN_NODES


@dataclasses.dataclass(frozen=True)
class LearnedBucket:
    """One rows bucket: ``relative_seconds`` nodes -> (round time / plain round time, timed rounds);
    the probe schedule (None: the bucket was still exploring)."""

    relative_seconds: dict[int, tuple[float, int]]
    probe_interval: int | None = None
    rounds_to_probe: int | None = None


@dataclasses.dataclass(frozen=True)
class Learned:
    """``acceptance``: nodes -> (mean acceptance length, samples); ``buckets``: rows bucket -> what it learned."""

    acceptance: dict[int, tuple[float, int]]
    buckets: dict[int, LearnedBucket]

    def to_json(self) -> dict:
        buckets = {str(b): {"relative_seconds": {str(n): [ratio, timed]
                                                 for n, (ratio, timed) in sorted(data.relative_seconds.items())},
                            "probe_interval": data.probe_interval, "rounds_to_probe": data.rounds_to_probe}
                   for b, data in sorted(self.buckets.items())}
        return {"acceptance": {str(n): [mean, samples] for n, (mean, samples) in sorted(self.acceptance.items())},
                "buckets": buckets}

    @classmethod
    def from_json(cls, data: object) -> Learned:
        """Parse :meth:`to_json`'s form; ValueError (TypeError: not an object) naming the malformed field."""
        if not isinstance(data, dict):
            raise TypeError(f"learned estimates must be an object, got {type(data).__name__}")
        acceptance = {_nodes(n): _pair(v, f"acceptance[{n}]", least=1.0) for n, v in _field(data, "acceptance").items()}
        buckets = {}
        for b, bucket in _field(data, "buckets").items():
            rows = _nodes(b)
            if rows < 1:
                raise ValueError(f"rows bucket must be >= 1, got {b!r}")
            ratios = {_nodes(n): _pair(v, f"buckets[{b}].relative_seconds[{n}]", least=0.0)
                      for n, v in _field(bucket, "relative_seconds").items()}
            buckets[rows] = LearnedBucket(ratios, _count(bucket.get("probe_interval"), "probe_interval", least=1),
                                          _count(bucket.get("rounds_to_probe"), "rounds_to_probe", least=0))
        if PLAIN_NODES in acceptance:
            raise ValueError("acceptance of plain rounds is 1 by definition; it is not learned")
        return cls(acceptance, buckets)


def _field(data: object, name: str) -> dict:
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, dict):
        raise TypeError(f"{name!r} must be an object")
    return value


def _nodes(text: object) -> int:
    try:
        nodes = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a node count or rows bucket, got {text!r}") from None
    if nodes < 0:
        raise ValueError(f"node counts are >= 0, got {nodes}")
    return nodes


def _pair(value: object, name: str, least: float) -> tuple[float, int]:
    """A [value, count] pair: a finite value >= ``least`` and a count >= 1."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"{name} must be [value, count], got {value!r}")
    number, count = value
    if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number) or number < least:
        raise ValueError(f"{name}'s value must be a finite number >= {least}, got {number!r}")
    if count is None:
        raise ValueError(f"{name}'s count is missing")
    return float(number), _count(count, name + "'s count", least=1)


def _count(value: object, name: str, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
