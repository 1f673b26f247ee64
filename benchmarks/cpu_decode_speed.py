"""CPU: tokens/s of flashtree decoding on the embedded default model, for A/B runs of two code trees.

Loads ``flashtree.LLM("smollm2")`` (plain decoding by default, or ``--spec ddtree`` with the shipped
drafter) from whatever ``flashtree`` is on the import path, warms up once, then times greedy
generation of ``--new-tokens`` tokens (end-of-sequence ignored) for a few chat prompts, batch 1,
``--threads`` threads, ``--repeats`` times each, and appends one JSON line (label, tokens/s per
run, their median, the tokens) to ``--out``. Run it alternately for two trees:

    for i in 1 2 3; do
      PYTHONPATH=/tmp/old python benchmarks/cpu_decode_speed.py --label before --out R.jsonl
      PYTHONPATH=. python benchmarks/cpu_decode_speed.py --label after --out R.jsonl
    done
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash map works, with an example in Python.",
           "What are three good habits for a new programmer?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", default="none")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import flashtree
    from flashtree.models.tokenizer import encode_chat

    llm = flashtree.LLM("smollm2", spec=args.spec, max_running=1, max_context=1024)
    params = flashtree.SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [encode_chat(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    llm.generate([prompts[0]], params)  # warm-up
    rates, tokens = [], []
    for _ in range(args.repeats):
        for ids in prompts:
            t0 = time.perf_counter()
            out = llm.generate([ids], params)[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - t0))
            tokens.append(out.token_ids)
    row = {"label": args.label, "spec": args.spec, "cpu": platform.processor() or platform.machine(),
           "threads": args.threads, "tok_s": rates, "median_tok_s": statistics.median(rates), "tokens": tokens}
    with Path(args.out).open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{args.label}: median {row['median_tok_s']:.1f} tok/s over {len(rates)} runs")


if __name__ == "__main__":
    main()
