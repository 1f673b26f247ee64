"""Per-method numbers: tau, throughput, speedup over plain decoding, and exactness.

Glossary
- tau: mean acceptance length, tokens committed per round with the bonus token included,
  pooled over every round of every prompt (plain decoding: 1.0).
- exact: the method produced token for token what plain decoding produced, on every prompt.
- divergence: the first output index where a prompt's tokens differ from plain decoding.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from flashtree.bench.runner import MethodRun

OTHER_STAGE = "other"  # wall time outside the engine's timed stages (scheduling, host work)


class Divergence(NamedTuple):
    prompt: int
    token: int  # first differing output index (a length difference counts at the shorter end)


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    for i, (ours, theirs) in enumerate(zip(tokens, reference)):
        if ours != theirs:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def divergences(run: MethodRun, reference: MethodRun) -> list[Divergence]:
    found = []
    for prompt, (ours, theirs) in enumerate(zip(run.outputs, reference.outputs)):
        token = first_divergence(ours, theirs)
        if token is not None:
            found.append(Divergence(prompt, token))
    return found


def generated_tokens(run: MethodRun) -> int:
    return sum(len(tokens) for tokens in run.outputs)


def tokens_per_second(run: MethodRun) -> float:
    return generated_tokens(run) / run.wall_seconds if run.wall_seconds > 0 else 0.0


def tau(run: MethodRun) -> float:
    lengths = run.acceptance_lengths
    return sum(lengths) / len(lengths) if lengths else 0.0


def acceptance_histogram(run: MethodRun) -> dict[str, int]:
    """{acceptance length: rounds}, keys as strings (JSON) in increasing length."""
    return {str(length): count for length, count in sorted(Counter(run.acceptance_lengths).items())}


def stage_seconds(run: MethodRun) -> dict[str, float]:
    stages = dict(run.stage_seconds)
    stages[OTHER_STAGE] = max(run.wall_seconds - sum(stages.values()), 0.0)
    return {name: round(seconds, 6) for name, seconds in stages.items()}


def summarize(run: MethodRun, reference: MethodRun) -> dict:
    """The JSON record of one method, compared with the plain-decoding ``reference``."""
    diverged = divergences(run, reference)
    rounds = len(run.acceptance_lengths)
    reference_speed = tokens_per_second(reference)
    return {
        "method": run.method.label,
        "spec": run.method.spec_method,
        "budget": run.budget,
        "tau": round(tau(run), 4),
        "tokens_per_s": round(tokens_per_second(run), 3),
        "speedup": round(tokens_per_second(run) / reference_speed, 4) if reference_speed else 0.0,
        "exact": not diverged,
        "mismatched_prompts": [d.prompt for d in diverged],
        "first_divergence": [d._asdict() for d in diverged],
        "generated_tokens": generated_tokens(run),
        "rounds": rounds,
        "wall_seconds": round(run.wall_seconds, 6),
        "ms_per_round": round(1000 * run.wall_seconds / rounds, 4) if rounds else 0.0,
        "mean_tree_size": round(sum(run.tree_sizes) / rounds, 3) if rounds else 0.0,
        "stage_seconds": stage_seconds(run),
        "graph_captures": run.graph_captures,
        "eager_rounds": run.eager_rounds,
        "acceptance_histogram": acceptance_histogram(run),
    }
