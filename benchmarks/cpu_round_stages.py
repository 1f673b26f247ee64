"""CPU: where a DDTree round of the embedded default goes, finer than ``flashtree bench --profile-stages``.

Wall-clock wrappers (this process only) around the pieces of a round: the drafter's block pass and
its lm_head, the tree build (top-k + layout), the target forward (prefills included: they are
reported apart from the rounds), the target's choice, the accept walk, the KV commit, the drafter's
observe of the accepted tokens and the result packing. SmolLM2 + the shipped drafter, fp32, batch 1,
greedy, held-out ShareGPT prompts, fixed budget (no adaptive policy). The wrappers add about 1 us
per call.

    python benchmarks/cpu_round_stages.py [--method ddtree:4] [--prompts 4] [--draft-vocab N] [--out FILE]

Writes results/cpu_round_stages.json by default (rename it by what it measured and the date); the
committed run is results/cpu_round_stages_epyc_2026-12-03.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import flashtree.engine.round as round_module
import flashtree.speculative.ddtree as ddtree_module
from flashtree.bench.datasets import load_prompts
from flashtree.bench.environment import environment
from flashtree.bench.methods import parse_methods
from flashtree.bench.runner import BenchSetup, generate, load_shared_target
from flashtree.config import EngineConfig, SpeculationConfig
from flashtree.engine.engine import LLMEngine
from flashtree.speculative.defaults import default_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_profile_plain import calls, seconds, timed  # noqa: E402  (the same wall-clock accumulators)

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_round_stages.json"


def install_timers(engine: LLMEngine) -> None:
    runner, proposer = engine.runner, engine.proposer
    drafter = proposer.runner.drafter
    drafter.target = drafter.target._replace(head=timed("draft: lm_head", drafter.target.head))
    drafter.draft_logits = timed("draft: block pass + lm_head", drafter.draft_logits)
    ddtree_module.build_tree = timed("draft: tree build", ddtree_module.build_tree)
    proposer.propose = timed("draft", proposer.propose)
    engine.model.forward = timed("target forward (rounds + prefills)", engine.model.forward)
    engine.prefill = timed("prefill", engine.prefill)
    round_module.choose_tokens = timed("verify: target choice", round_module.choose_tokens)
    round_module.accept_walk = timed("commit: accept walk", round_module.accept_walk)
    engine.cache.commit = timed("commit: KV commit", engine.cache.commit)
    proposer.observe = timed("commit: drafter observe", proposer.observe)
    round_module.pack = timed("commit: pack", round_module.pack)
    runner.round_program = timed("round (device work)", runner.round_program)
    engine.step = timed("engine step", engine.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ddtree:4")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=None, help="draft from the N most frequent tokens")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    method = parse_methods(args.method)[-1]  # (parse_methods puts plain decoding first)
    base = SpeculationConfig(method="ddtree", draft=default_spec("smollm2", "ddtree", None)[1],
                             draft_vocab=args.draft_vocab, adaptive=False)  # each method as named
    engine_config = EngineConfig.of(spec=base, model="smollm2", device="cpu", max_running=1, max_context=2048,
                                    incremental_text=False)
    setup = BenchSetup(engine=engine_config, max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    config = setup.engine_config(method)
    target = load_shared_target(config)
    prompts = [p.encode(target.tokenizer) for p in load_prompts("sharegpt-heldout", args.prompts)]
    engine = LLMEngine(config, target=target)
    generate(engine, prompts[:1], [setup.sampling(0, 16)])  # warm-up, untimed
    install_timers(engine)
    start = time.perf_counter()
    requests = generate(engine, prompts, [setup.sampling(i) for i in range(len(prompts))])
    wall = time.perf_counter() - start
    rounds = calls["round (device work)"]
    accepted = [n for r in requests for n in r.stats.acceptance_lengths]
    per_round = {label: round(1e3 * s / rounds, 3) for label, s in seconds.items()}
    per_round["target forward in rounds"] = round(
        per_round["target forward (rounds + prefills)"] - 1e3 * seconds["prefill"] / rounds, 3)  # (prefills: one forward per chunk)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "method": args.method,
           "draft_vocab": args.draft_vocab,
           "prompts": len(prompts), "rounds": rounds, "tau": round(sum(accepted) / len(accepted), 3),
           "wall_s": round(wall, 3), "prefill_s": round(seconds["prefill"], 3), "ms_per_round": per_round,
           "calls": dict(calls)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.method}: {rounds} rounds, tau {out['tau']}, wall {wall:.2f} s (prefills {seconds['prefill']:.2f} s)")
    for label, ms in sorted(per_round.items(), key=lambda kv: -kv[1]):
        print(f"  {label:40s} {ms:8.3f} ms / round")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
