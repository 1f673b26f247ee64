"""CPU, SmolLM2 + the shipped drafter, fp32, batch 1: what a DDTree engine costs beyond plain
decoding when its rounds are plain (the adaptive policy's fallback), and what one draft costs.

Systems, interleaved over --repeats (the machine is shared: compare within a run):
- plain: the plain engine;
- deferred: a DDTree engine pinned to plain rounds (the drafter's context projection deferred,
  flashtree's behaviour);
- every round: the same engine with deferral off (``project_every_round``: no lag bookkeeping, no
  feature sink, the round's features observed at once), so the drafter projects each committed
  token at once (the behaviour before deferral).
All three must give the same tokens. Also times one ``draft_logits`` call (budget-4 depth).

    python benchmarks/cpu_plain_round_upkeep.py [--repeats 3] [--new-tokens 128] [--batch 1] [--out FILE]

``--batch N`` runs N chats at once (the same question in N wordings), as a server's batch would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.environment import cpu_name
from flashtree.engine.round import DeviceRound, RoundInputs
from flashtree.policy import FixedNodes
from flashtree.speculative.drafter import DrafterLag

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_plain_round_upkeep.json"
CHAT = [[{"role": "user", "content": "Explain how a hash map works and when to use one."}]]


class ProjectedEveryRound:
    """The proposer as the round program sees it, with ``defer`` projecting at once: each plain
    round's committed token goes through the drafter's ``observe`` at its position, as before
    deferral (``starts``: the round's, set by :class:`ProjectingRound` before each round)."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.starts = None

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def defer(self, slots, features, lags, counts=None):
        counts = torch.full_like(slots, features.shape[1]) if counts is None else counts
        self.proposer.observe(slots, features, counts, self.starts)


class ProjectingRound(DeviceRound):
    """The engine's device round with the drafter projecting every committed token at once (the
    plain round's features go to ``observe`` instead of the lag buffer)."""

    def __init__(self, round_program: DeviceRound):
        super().__init__(round_program.model, round_program.cache, ProjectedEveryRound(round_program.proposer),
                         round_program.kernels, round_program.tracing)

    def __call__(self, shape, *tensors, **options):
        self.proposer.starts = RoundInputs(*tensors).starts
        return super().__call__(shape, *tensors, **options)


def project_every_round(engine) -> None:
    """Deferral off in ``engine`` (built with ``feature_sink=False``: the sink is where a deferring
    proposer keeps a plain round's features): its lag bookkeeping has capacity 0, so prompts are
    projected at prefill, nothing is counted and no catch-up runs, and the round program projects
    each plain round's token at once."""
    if engine.config.kernels.feature_sink:
        raise ValueError("projecting every round needs the engine built with feature_sink=False")
    engine.lag = engine.overlap.lag = DrafterLag(capacity=0)  # the engine's; the proposer keeps its own
    engine.runner.round_program = ProjectingRound(engine.runner.round_program)


def engines(batch: int) -> dict[str, LLM]:
    running = max(2, batch)
    plain = LLM("smollm2", max_running=running, max_context=512)
    deferred = LLM("smollm2", spec="ddtree", budget=4, max_running=running, max_context=512)
    deferred.engine.policy = FixedNodes(0)  # plain rounds only
    eager = LLM("smollm2", spec="ddtree", budget=4, max_running=running, max_context=512, feature_sink=False)
    eager.engine.policy = FixedNodes(0)
    project_every_round(eager.engine)
    return {"plain": plain, "ddtree engine, plain rounds, deferred": deferred,
            "ddtree engine, plain rounds, projected every round": eager}


def draft_ms(llm: LLM, reps: int = 20) -> float:
    """Wall ms of one draft_logits call at the default CPU budget's depth, after a short chat."""
    runner = llm.engine.proposer.runner
    seen = []
    real = runner.draft_logits
    runner.draft_logits = lambda rows, depth=None: seen.append((rows, depth)) or real(rows, depth)
    llm.chat(CHAT, SamplingParams(max_tokens=32, ignore_eos=True))
    runner.draft_logits = real
    rows, depth = seen[-1]
    for _ in range(3):
        real(rows, depth)
    start = time.perf_counter()
    for _ in range(reps):
        real(rows, depth)
    return 1000 * (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems = engines(args.batch)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": CHAT[0][0]["content"] + " " * (i % 2) + "Answer briefly." * (i // 2)}]
             for i in range(args.batch)]
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        tokens = []
        for name, llm in systems.items():
            start = time.perf_counter()
            outs = llm.chat(chats, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            tokens.append([o.token_ids for o in outs])
        assert all(t == tokens[0] for t in tokens), "a system's tokens differ from plain decoding"
    drafter = LLM("smollm2", spec="ddtree", budget=4, adaptive_spec=False, max_running=2, max_context=512)
    result = {
        "machine": f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}",
        "command": "python benchmarks/cpu_plain_round_upkeep.py "
                   + f"--repeats {args.repeats} --new-tokens {args.new_tokens} --batch {args.batch}",
        "tokens_per_s_median": {name: round(statistics.median(v), 1) for name, v in rates.items()},
        "tokens_per_s_all": {name: [round(x, 1) for x in v] for name, v in rates.items()},
        "draft_logits_ms_depth4": round(draft_ms(drafter), 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
