"""Would a frequency-ranked draft vocabulary (the drafter's lm_head over the N most frequent tokens
only, as FR-Spec does) pay on the CPU? Two numbers decide it for the embedded default:

- coverage: the share of SmolLM2's own greedy output tokens (held-out ShareGPT prompts) and of
  held-out ShareGPT assistant text that fall inside the top N tokens by frequency in the training
  split's assistant turns (a drafted token outside them can never be proposed);
- the drafter's lm_head over 4 positions (a DDTree-4 round's depth) from the N rows of the target's
  Q8_0 blocks, and the top-k + log-normalizer after it, against the full 49,152 rows.

    python benchmarks/cpu_draft_vocab_coverage.py [--train-conversations 6000] [--out FILE]

Writes results/cpu_draft_vocab_coverage.json by default (rename it by what it measured and the
date); the committed run is results/cpu_draft_vocab_coverage_epyc_2026-12-03.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import flashtree
from flashtree import SamplingParams
from flashtree.bench.datasets import load_prompts
from flashtree.bench.environment import environment
from flashtree.kernels.cpu.quant_linear import QuantizedLinear
from flashtree.train.data import SHAREGPT, load_conversations, split_conversations
from flashtree.train.draft_vocab import assistant_tokens, rank_tokens

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_draft_vocab_coverage.json"
SIZES = (4096, 8192, 16384, 24576)


def ms_per_call(fn, calls: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-conversations", type=int, default=6000)
    parser.add_argument("--heldout-conversations", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts the target answers greedily")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=1024)
    tokenizer = llm.tokenizer
    train, heldout = split_conversations(load_conversations(SHAREGPT))
    train_tokens = assistant_tokens(tokenizer, train[:args.train_conversations])
    ranked = rank_tokens(train_tokens)  # the shipped ranking's rule (ties by id)
    heldout_text = np.array(assistant_tokens(tokenizer, heldout[:args.heldout_conversations]))
    prompts = [p.encode(tokenizer) for p in load_prompts("sharegpt-heldout", args.prompts)]
    greedy = np.array([t for o in llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
                       for t in o.token_ids])
    head = llm.engine.model.lm_head_quant
    hidden = torch.randn(4, head.in_features)
    rows = []
    for size in (*SIZES, head.out_features):
        subset = torch.tensor(ranked[:size] if size < head.out_features else range(size))
        sub_head = QuantizedLinear(head.type_name, head.blocks.index_select(0, subset).contiguous(), head.in_features)
        head_ms = ms_per_call(lambda: sub_head(hidden))
        both_ms = ms_per_call(lambda: (lambda logits: (logits.topk(4), logits.logsumexp(-1)))(sub_head(hidden)))
        rows.append({"tokens": size, "greedy_output_coverage": round(float(np.isin(greedy, subset.numpy()).mean()), 4),
                     "heldout_text_coverage": round(float(np.isin(heldout_text, subset.numpy()).mean()), 4),
                     "head_4_rows_ms": round(head_ms, 3), "topk_and_normalizer_ms": round(both_ms - head_ms, 3)})
        print(json.dumps(rows[-1]), flush=True)
    out = {**environment(torch.device("cpu")), "threads": args.threads, "train_conversations": args.train_conversations,
           "train_tokens": len(train_tokens), "distinct_train_tokens": len(ranked),
           "greedy_tokens": int(greedy.size), "heldout_text_tokens": int(heldout_text.size), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
