"""Summarize a speculation policy trace (``flashtree serve --trace-policy FILE``) per load-test pass.

A pass is a stretch of rounds with no pause longer than ``--gap-s`` (the load generator pauses
between passes). For each pass: its rows (most common), rounds, tree rounds, and the wall time the
tree rounds took beyond a median plain round of the same pass, split into

- exploration: a tree round of an option with fewer than ``explore_rounds`` (2) timed rounds in its
  rows bucket before it (``estimates.options`` of the previous round of that bucket),
- untimed: any other tree round the policy was not fed a time for (a capture or an eager probe),
- timed: the rest (probes, rechecks, chosen trees),

so a pass's loss against a plain server can be traced to what caused it.

    python benchmarks/policy_trace_summary.py TRACE.jsonl[.gz] [--gap-s 0.5] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter
from pathlib import Path

EXPLORE_ROUNDS = 2  # flashtree.config.PolicyConfig.explore_rounds (the default every server here runs)


def rows_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def read_trace(path: Path) -> list[dict]:
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
        return [json.loads(line) for line in f if line.strip()]


def split_passes(lines: list[dict], gap_s: float) -> list[list[dict]]:
    """Rounds grouped into passes: a new pass starts after a pause of more than ``gap_s`` between
    the end of one round and the end of the next minus its own wall time."""
    passes: list[list[dict]] = []
    last_end = None
    for line in lines:
        start = line["t"] - (line["wall_ms"] or 0.0) / 1000
        if last_end is None or start - last_end > gap_s:
            passes.append([])
        passes[-1].append(line)
        last_end = line["t"]
    return passes


def timed_before(lines: list[dict]) -> list[int]:
    """Per round: the timed rounds its option had in its bucket before it (from the estimates the
    previous round of the same bucket left)."""
    last: dict[int, dict[int, int]] = {}  # bucket -> nodes -> timed rounds
    counts = []
    for line in lines:
        bucket = rows_bucket(line["rows"])
        counts.append(last.get(bucket, {}).get(line["nodes"], 0))
        options = line.get("estimates", {}).get("options", [])
        last[bucket] = {nodes: timed for nodes, _acc, _ms, timed in options}
    return counts


def summarize_pass(lines: list[dict], timed: list[int]) -> dict:
    plain = [l["wall_ms"] for l in lines if l["nodes"] == 0 and l["ms"] is not None]
    plain_ms = statistics.median(plain) if plain else None
    extra = Counter()
    kinds = Counter()
    for line, before in zip(lines, timed):
        if line["nodes"] == 0:
            continue
        kind = "exploration" if before < EXPLORE_ROUNDS else ("untimed" if line["ms"] is None else "timed")
        kinds[kind] += 1
        extra[kind] += line["wall_ms"] - (plain_ms or 0.0)
    wall = sum(l["wall_ms"] for l in lines)
    return {
        "rows": Counter(l["rows"] for l in lines).most_common(1)[0][0],
        "rounds": len(lines),
        "tree_rounds": sum(kinds.values()),
        "tree_rounds_by_kind": dict(kinds),
        "median_plain_ms": plain_ms,
        "round_wall_ms": round(wall, 1),
        "tree_extra_ms_by_kind": {k: round(v, 1) for k, v in extra.items()},
        "tree_extra_share": round(sum(extra.values()) / wall, 4) if wall else None,
    }


def summarize(path: Path, gap_s: float) -> list[dict]:
    lines = read_trace(path)
    timed = timed_before(lines)
    out, index = [], 0
    for stretch in split_passes(lines, gap_s):
        out.append(summarize_pass(stretch, timed[index:index + len(stretch)]))
        index += len(stretch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap-s", type=float, default=0.5, help="a pause longer than this starts a new pass")
    parser.add_argument("--json", type=Path, help="write the per-pass summary here")
    args = parser.parse_args()
    passes = summarize(args.trace, args.gap_s)
    for i, p in enumerate(passes):
        print(f"pass {i:2d}: rows {p['rows']:2d}, {p['rounds']:5d} rounds, {p['tree_rounds']:3d} tree "
              f"{p['tree_rounds_by_kind']}, plain {p['median_plain_ms']} ms, tree extra "
              f"{p['tree_extra_ms_by_kind']} = {p['tree_extra_share']:.1%} of {p['round_wall_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(passes, indent=1) + "\n")


if __name__ == "__main__":
    main()
