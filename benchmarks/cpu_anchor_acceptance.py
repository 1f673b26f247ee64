"""Engine tau against per-anchor acceptance: why DFlash's tau in the engine (2.10 with the shipped
SmolLM2 drafter) sits far below the trainer's held-out estimate (3.39), measured on the same text.

For each prompt (held-out ShareGPT, greedy, fp32, CPU):
1. the plain continuation of ``--new-tokens`` tokens, and DFlash's rounds over it (the engine's tau);
2. the acceptance length of a DFlash round anchored at every output position i: a request whose
   prompt is the prompt plus the first i output tokens decodes one round from there (its prefill
   gives output i as the bonus token; checked). Their plain mean is what a trainer's estimate
   averages: blocks anchored uniformly over the answer;
3. the engine's walk over those lengths: start at 0, and from anchor i go to i + length(i), as
   rounds do. It must give the engine's rounds (checked: rounds and tau of the walk next to the
   engine's), so step 2 measures what the engine does.

The engine's tau is output tokens / rounds along the walk: a long accepted run is crossed by one
round, a stretch of misses costs a round per token. So tau is dominated by the hard stretches,
while the uniform mean over anchors counts each position of an easy run once. The gap is the
statistic, not a mismatch between training and inference.

    python benchmarks/cpu_anchor_acceptance.py [--prompts 4] [--new-tokens 128] [--out FILE]

Writes results/cpu_anchor_acceptance.json by default (rename it by what it measured and the date);
the committed run is results/cpu_anchor_acceptance_smollm2_v3_xeon_2026-12-01.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import load_prompts
from flashtree.bench.environment import cpu_name

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_anchor_acceptance.json"


def walk(lengths: dict[int, int], total: int) -> list[int]:
    """Anchors the engine's rounds start from: 0, then i + length(i), while below ``total`` - 1."""
    anchors, i = [], 0
    while i < total - 1 and i in lengths:
        anchors.append(i)
        i += lengths[i]
    return anchors


def one_prompt(plain: LLM, dflash: LLM, prompt_ids: list[int], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    output = plain.generate([prompt_ids], params)[0].token_ids
    engine = dflash.generate([prompt_ids], params)[0]
    assert engine.token_ids == output, "DFlash must give the plain tokens"
    probes = [prompt_ids + output[:i] for i in range(new_tokens - 1)]
    one_round = SamplingParams(max_tokens=2 * dflash.engine.proposer.max_depth, ignore_eos=True)
    runs = dflash.generate(probes, one_round)
    lengths, mismatched = {}, 0
    for i, run in enumerate(runs):
        if run.token_ids[0] != output[i]:  # a full prefill chose another first token (rounding)
            mismatched += 1
            continue
        lengths[i] = run.acceptance_lengths[0]
    anchors = walk(lengths, new_tokens)
    walked = [lengths[i] for i in anchors]
    return {
        "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
        "engine_rounds": engine.rounds, "engine_tau": engine.mean_acceptance_length,
        "walk_rounds": len(anchors), "walk_tau": statistics.fmean(walked) if walked else None,
        "anchor_mean_acceptance": statistics.fmean(lengths.values()),
        "anchors_measured": len(lengths), "anchors_with_other_first_token": mismatched,
        "acceptance_by_anchor": [lengths.get(i) for i in range(new_tokens - 1)],
        "engine_acceptance_lengths": engine.acceptance_lengths,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    engine = dict(device="cpu", dtype="float32", max_running=16, max_context=1024)
    plain = LLM("smollm2", **engine)
    dflash = LLM("smollm2", spec="dflash", adaptive_spec=False, **engine)
    rows = []
    for n, prompt in enumerate(load_prompts("sharegpt-heldout", args.prompts)):
        row = one_prompt(plain, dflash, prompt.encode(plain.tokenizer), args.new_tokens)
        rows.append(row)
        print(f"prompt {n}: engine tau {row['engine_tau']:.2f} ({row['engine_rounds']} rounds), walk "
              f"{row['walk_tau']:.2f} ({row['walk_rounds']} rounds), mean over anchors "
              f"{row['anchor_mean_acceptance']:.2f}", flush=True)
    tokens = sum(r["engine_rounds"] * r["engine_tau"] for r in rows)
    summary = {
        "engine_tau": tokens / sum(r["engine_rounds"] for r in rows),
        "walk_tau": sum(r["walk_rounds"] * r["walk_tau"] for r in rows) / sum(r["walk_rounds"] for r in rows),
        "anchor_mean_acceptance": statistics.fmean(a for r in rows for a in r["acceptance_by_anchor"] if a),
    }
    result = {"what": "DFlash (shipped SmolLM2 drafter) engine tau vs acceptance of rounds anchored at every output "
                      "position, held-out ShareGPT, greedy, fp32, 128 tokens past the end of sequence",
              "cpu": cpu_name(), "torch": torch.__version__, "prompts": args.prompts, "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
