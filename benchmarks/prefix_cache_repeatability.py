"""Does a cached prompt prefix change greedy tokens? The same prompts decoded twice by one engine with prefix
caching on (the second pass finds each prompt's full pages cached and prefills only the rest), against an
engine without it, for plain decoding and each speculative method.

    python benchmarks/prefix_cache_repeatability.py [--model smollm2] [--methods none,ddtree:16] \
        [--dataset humaneval --prompts 4 --new-tokens 48] --out benchmarks/results/prefix_cache_repeatability.json

Per method and pass: the prompts whose tokens differ from the uncached plain engine's, with the first
differing position and how many of the prompt's tokens fill whole pages (what a later pass may find cached),
and the mean acceptance length (the drafter reads the target's features of the prefilled tokens only). Plain
and speculative decoding on one engine agree with each other in every pass (the lossless contract); this
measures whether a pass's cache state moves them.
"""

import argparse
from pathlib import Path

from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import load_prompts
from flashtree.bench.report import write_json


def engine(model: str, method: str, prefix_caching: bool, rows: int) -> LLM:
    spec, _, budget = method.partition(":")
    keywords = dict(spec=spec, budget=int(budget) if budget else None, adaptive_spec=False) if spec != "none" else {}
    return LLM(model, prefix_caching=prefix_caching, max_running=rows, **keywords)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="none,ddtree:16")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    reference = engine(args.model, "none", False, args.prompts)
    ids = [p.encode(reference.tokenizer) for p in load_prompts(args.dataset, args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    expected = [out.token_ids for out in reference.generate(ids, params)]
    page = reference.engine.config.cache.page_size
    report = {"model": args.model, "dataset": args.dataset, "new_tokens": args.new_tokens,
              "device": str(reference.engine.device), "dtype": str(reference.engine.dtype), "page_size": page,
              "prompt_tokens": [len(p) for p in ids], "rows": []}
    for method in args.methods.split(","):
        llm = engine(args.model, method, True, args.prompts)
        for index in range(args.passes):
            outs = llm.generate(ids, params)
            stats = llm.stats(reset=True)
            differing = [{"prompt": i, "first_differing_token": first_difference(out.token_ids, want),
                          "prompt_tokens_in_full_pages": (len(ids[i]) // page) * page}
                         for i, (out, want) in enumerate(zip(outs, expected)) if out.token_ids != want]
            row = {"method": method, "pass": index, "prompts_differing_from_uncached_plain": differing,
                   "mean_acceptance_length": stats.mean_acceptance_length}
            print(row, flush=True)
            report["rows"].append(row)
        del llm
    write_json(report, args.out)


if __name__ == "__main__":
    main()
