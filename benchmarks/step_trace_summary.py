"""Summarize engine step traces (``flashtree serve --trace-steps FILE``) per load-test pass, for
one or more servers side by side: where each pass's wall time went, per round.

A pass is a stretch of steps with no gap longer than ``--gap-s`` (a paired load test runs the
other servers in between). Per pass: its rounds and most common rows, and per round (ms) the
round itself, prefill, the rest of the step (appending tokens, freeing slots), and the gap
before the step (the server's host work outside the engine, the command queue); the median gap.
Also per pass (``rounds`` in the JSON, a second line when printed): the plain rounds' median and
mean, the tree rounds and what they cost over as many plain rounds, the slow rounds (over
``SLOW_FACTOR`` times the median round: captures, rounds waiting on a prefill) and their time, and
the prefills' count and total time.

    python benchmarks/step_trace_summary.py none=steps_none.jsonl ddtree=steps_ddtree.jsonl [--gap-s 0.3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_trace_summary import read_trace  # noqa: E402


def split_passes(lines: list[dict], gap_s: float) -> list[list[dict]]:
    passes: list[list[dict]] = []
    for line in lines:
        if not passes or line["gap_ms"] is None or line["gap_ms"] > gap_s * 1000:
            passes.append([])
        passes[-1].append(line)
    return passes


def summarize_pass(steps: list[dict]) -> dict:
    """Per-round means (ms) of a pass's time by part; the first step's gap (the pause before the
    pass) is left out."""
    rounds = sum(1 for s in steps if s["round_ms"] is not None)
    parts = Counter()
    for i, s in enumerate(steps):
        parts["round"] += s["round_ms"] or 0.0
        parts["prefill"] += s["prefill_ms"] or 0.0
        parts["rest_of_step"] += s["step_ms"] - (s["round_ms"] or 0.0) - (s["prefill_ms"] or 0.0)
        if i:
            parts["gap"] += s["gap_ms"]
    gaps = [s["gap_ms"] for s in steps[1:]]
    return {
        "rows": Counter(s["rows"] for s in steps if s["rows"]).most_common(1)[0][0] if rounds else 0,
        "rounds": rounds,
        "ms_per_round": {k: round(v / max(rounds, 1), 4) for k, v in parts.items()},
        "wall_ms": round(sum(parts.values()), 1),
        "median_gap_ms": round(statistics.median(gaps), 4) if gaps else None,
    }


SLOW_FACTOR = 1.5


def round_detail(steps: list[dict]) -> dict:
    """A pass's rounds in detail (ms): plain rounds' median and mean, tree rounds' count and their
    cost over that many median plain rounds, slow rounds (> SLOW_FACTOR x the median round), prefills."""
    rounds = [s for s in steps if s["round_ms"] is not None]
    plain = [s["round_ms"] for s in rounds if not s["nodes"]]
    tree = [s["round_ms"] for s in rounds if s["nodes"]]
    median = statistics.median(s["round_ms"] for s in rounds)
    plain_median = statistics.median(plain) if plain else None
    slow = [s["round_ms"] for s in rounds if s["round_ms"] > SLOW_FACTOR * median]
    prefills = [s["prefill_ms"] for s in steps if s["prefill_ms"] is not None]
    return {
        "plain_median_ms": round(plain_median, 4) if plain else None,
        "plain_mean_ms": round(statistics.mean(plain), 4) if plain else None,
        "tree_rounds": len(tree),
        "tree_extra_ms": round(sum(tree) - len(tree) * plain_median, 1) if tree and plain else None,
        "slow_rounds": len(slow), "slow_ms": round(sum(slow), 1),
        "prefills": len(prefills), "prefill_ms": round(sum(prefills), 1),
    }


def summarize(path: Path, gap_s: float, min_rounds: int) -> list[dict]:
    passes = []
    for steps in split_passes(read_trace(path), gap_s):
        summary = summarize_pass(steps)
        if summary["rounds"] >= min_rounds:
            passes.append({**summary, "detail": round_detail(steps)})
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="NAME=FILE (.jsonl or .jsonl.gz)")
    parser.add_argument("--gap-s", type=float, default=0.3, help="a pause longer than this starts a new pass")
    parser.add_argument("--min-rounds", type=int, default=50, help="leave out shorter passes (warm-up requests)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = {}
    for entry in args.traces:
        name, _, file = entry.partition("=")
        out[name] = summarize(Path(file), args.gap_s, args.min_rounds)
        for i, p in enumerate(out[name]):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in p["ms_per_round"].items())
            print(f"{name:>8} pass {i:2d}: rows {p['rows']:2d}, {p['rounds']:5d} rounds; ms per round: {parts}; "
                  f"median gap {p['median_gap_ms']} ms")
            print(" " * 18 + ", ".join(f"{k} {v}" for k, v in p["detail"].items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
