"""Where speculative and plain decoding part at bf16, and why.

    python benchmarks/bf16_divergence.py --draft DRAFTER --prompts held_out.jsonl [--dtype bfloat16]

For each prompt: greedy plain decoding and greedy DFlash; at the first token where they differ,
one forward over the whole prefix (no speculation) shows which token a multi-token forward picks
and the top-2 logit margin. When the full-prefix forward agrees with DFlash, the difference is
the forward shape's rounding, not the speculation.
"""

import argparse
import json

import torch

from flashtree import LLM, SamplingParams
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.tokenizer import encode_chat


def full_prefix_top2(model, ids):
    cfg = model.config
    cache = KVCache(KVCacheSpec(cfg.num_hidden_layers, 1, len(ids), 1, cfg.num_key_value_heads, cfg.head_dim),
                    model.lm_head.weight.dtype, model.lm_head.weight.device)
    n = len(ids)
    batch = ForwardBatch(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]), torch.tensor([0]),
                         causal_mask(torch.tensor([n]), n), n)
    top = model(batch, cache).logits[0, -1].topk(2)
    return top.indices.tolist(), (top.values[0] - top.values[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True, help='JSONL of {"messages": [...]} or {"prompt": ...}')
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in open(args.prompts)][:args.num_prompts]
    chats = [r["messages"][:1] if "messages" in r else [{"role": "user", "content": r["prompt"]}] for r in rows]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = LLM(args.model, dtype=args.dtype, max_context=2048, max_running=1)
    spec = LLM(args.model, dtype=args.dtype, spec="dflash", draft=args.draft, max_context=2048, max_running=1)
    for i, (a, b) in enumerate(zip(plain.chat(chats, params), spec.chat(chats, params))):
        if a.token_ids == b.token_ids:
            print(f"prompt {i}: identical ({len(a.token_ids)} tokens, DFlash tau {b.mean_acceptance_length:.2f})")
            continue
        k = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        ids = encode_chat(plain.tokenizer, chats[i]) + a.token_ids[:k]
        top2, margin = full_prefix_top2(plain.engine.model, ids)
        print(f"prompt {i}: first difference at token {k}: plain {a.token_ids[k]}, DFlash {b.token_ids[k]}; "
              f"full-prefix forward top-2 {top2}, margin {margin:.4f}")


if __name__ == "__main__":
    main()
