"""Is plain decoding repeatable at bf16, and where does it stop being? (issue #29, first part)

    python benchmarks/bf16_repeatability.py --model DIR --random-weights --out results/x.json

For each engine variant (default; CUDA graphs off; queued rounds off; Triton kernels off; all of
them off), one engine decodes the same prompts greedily, with the chosen token's log-probability:
- batch 1 (one prompt at a time), twice: the prompts whose tokens, or whose log-probabilities,
  differ between the two passes, and the first position where they do;
- batch 16 (all prompts together), twice: the same;
- copies: half the prompts, each twice in one batch of 16: pairs whose copies differ;
- batch 1 against batch 16: prompts whose tokens differ (batch invariance; the fast mode is not
  expected to have it).
A log-probability that differs bitwise with the same token shows where rounding first parts.
"""

import argparse
import json
import time

import torch

from flashtree import LLM, SamplingParams

VARIANTS = {
    "default": {},
    "no_graphs": {"cuda_graphs": False},
    "no_queued_rounds": {"queue_plain_rounds": False},
    "no_triton": {"gpu_kernels": False},
    "all_off": {"cuda_graphs": False, "queue_plain_rounds": False, "gpu_kernels": False},
}


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 600, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool):
    """Per prompt: (tokens, the chosen tokens' log-probabilities)."""
    runs = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = [o for run in runs for o in llm.generate(run, params)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def first_difference(a, b) -> dict | None:
    """Where two (tokens, logprobs) runs first part: the token index and whether tokens or only
    log-probabilities differ there."""
    (ta, la), (tb, lb) = a, b
    for i, (x, y, p, q) in enumerate(zip(ta, tb, la, lb)):
        if x != y:
            return {"position": i, "what": "token"}
        if p != q:
            return {"position": i, "what": "logprob"}
    return None


def compare(runs_a, runs_b) -> dict:
    diffs = [first_difference(a, b) for a, b in zip(runs_a, runs_b)]
    token = [d["position"] for d in diffs if d and d["what"] == "token"]
    logprob_only = [d["position"] for d in diffs if d and d["what"] == "logprob"]
    token_any = sum(a[0] != b[0] for a, b in zip(runs_a, runs_b))
    return {"prompts": len(diffs), "tokens_differ": token_any, "logprobs_differ_first": len(logprob_only),
            "first_positions_token": token, "first_positions_logprob": logprob_only}


def run_variant(args, overrides: dict) -> dict:
    engine_kwargs = {"max_running": 16, "max_context": 1024 + args.max_tokens}
    llm = LLM(args.model, random_weights=args.random_weights, dtype=args.dtype, **engine_kwargs, **overrides)
    vocab = llm.engine.model.config.vocab_size
    prompts = random_prompts(args.num_prompts, vocab, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    b1 = [decode(llm, prompts, params, True) for _ in range(2)]
    b16 = [decode(llm, prompts, params, False) for _ in range(2)]
    half = prompts[: len(prompts) // 2]
    copies = decode(llm, [p for p in half for _ in range(2)], params, False)
    pairs = [first_difference(copies[2 * i], copies[2 * i + 1]) for i in range(len(half))]
    result = {
        "batch1_pass_to_pass": compare(*b1),
        "batch16_pass_to_pass": compare(*b16),
        "copies_in_one_batch": {"pairs": len(pairs), "differ": sum(d is not None for d in pairs),
                                "first_positions": [d for d in pairs if d]},
        "batch1_vs_batch16": compare(b1[0], b16[0]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    del llm
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"device": device, "model": args.model, "random_weights": args.random_weights, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "variants": {}}
    for name in args.variants.split(","):
        report["variants"][name] = run_variant(args, VARIANTS[name])
        r = report["variants"][name]
        print(f"{name:17s} b1 {r['batch1_pass_to_pass']['tokens_differ']}/{args.num_prompts} tokens "
              f"(+{r['batch1_pass_to_pass']['logprobs_differ_first']} logprob-only)  "
              f"b16 {r['batch16_pass_to_pass']['tokens_differ']} (+{r['batch16_pass_to_pass']['logprobs_differ_first']})  "
              f"copies {r['copies_in_one_batch']['differ']}/{r['copies_in_one_batch']['pairs']}  "
              f"b1-vs-b16 {r['batch1_vs_batch16']['tokens_differ']}  {r['seconds']} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
