"""H200: is the exact mode exact? Speculative tokens against plain tokens in bf16, at several batch sizes.

    python benchmarks/gpu_exact_mode.py --model /tmp/flashtree-qwen3-8b --random-weights \
        --draft /tmp/flashtree-qwen3-8b-dflash --out benchmarks/results/gpu_exact_mode_8b.json
    python benchmarks/gpu_exact_mode.py --model smollm2-135m-instruct-q4_1.gguf --out ...  (the real pair)

Greedy decoding of random token-id prompts (seeded; 16-300 tokens) with plain decoding and each method, at
each batch size (``--batches``: that many requests at a time), at least ``--tokens`` generated tokens per
(method, batch). Reports, per (method, batch), the token lists that differ from plain decoding at the same
batch size and from plain decoding at batch 1, and for plain decoding a second pass on the same engine
(repeatability) and copies of one prompt in one batch. All zeros: exact. ``--no-exact`` measures the fast mode
the same way. ``--qwen3-8b-shape DIR`` writes the 8B-shape configs (target and drafter) there first.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b_shape import QWEN3_8B, QWEN3_8B_DFLASH, write_config  # noqa: E402

from flashtree import LLM, SamplingParams  # noqa: E402


def prompts_for(count: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(16, 300, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += [o.token_ids for o in llm.generate(prompts[i:i + batch], params)]
    return out, time.perf_counter() - start


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or GGUF (or --qwen3-8b-shape)")
    parser.add_argument("--draft", default=None, help="the drafter (default: the model's default drafter)")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--qwen3-8b-shape", metavar="DIR", help="write the 8B-shape configs under DIR first")
    parser.add_argument("--methods", default="dflash,ddtree:16,ddtree:64,ddtree:256")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=4096, help="generated tokens per (method, batch), at least")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per request (default: --tokens over the largest batch, at least 16, so "
                             "that the largest batch's one pass makes --tokens)")
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda", help="cuda; cpu for a dry run of this script (with --no-exact)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.qwen3_8b_shape:
        args.model = str(write_config(Path(args.qwen3_8b_shape) / "target", QWEN3_8B))
        args.draft = str(write_config(Path(args.qwen3_8b_shape) / "drafter", QWEN3_8B_DFLASH))
    if not args.model:
        parser.error("--model or --qwen3-8b-shape is required")
    batches = [int(b) for b in args.batches.split(",")]
    args.max_tokens = args.max_tokens or max(16, args.tokens // max(batches))
    common = {"dtype": args.dtype, "device": args.device, "exact": args.exact, "random_weights": args.random_weights,
              "max_running": max(batches), "max_context": 1024, "adaptive_spec": False}
    plain = LLM(args.model, spec="none", **common)
    vocab = plain.engine.model.config.vocab_size
    count = max(max(batches), -(-args.tokens // args.max_tokens))
    prompts = prompts_for(count, vocab, seed=0)
    reference, rows = {}, []

    def save() -> None:  # after every row: a run cut short still leaves its rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                                              "torch": torch.__version__, "model": args.model, "exact": args.exact,
                                              "rows": rows}, indent=1))

    for batch in batches:
        n = max(count, batch) // batch * batch
        tokens, seconds = run(plain, prompts[:n], batch, args.max_tokens)
        again, _ = run(plain, prompts[:n], batch, args.max_tokens)
        reference[batch] = tokens
        half = batch // 2  # copies: the batch's second half repeats its first half
        copies = prompts[:half] * 2 if batch > 1 else []
        copy_tokens = run(plain, copies, batch, args.max_tokens)[0] if copies else []
        rows.append({"method": "ar", "batch": batch, "requests": n, "tokens": sum(map(len, tokens)),
                     "seconds": seconds, "differ_pass_to_pass": differing(tokens, again),
                     "differ_vs_batch_1": differing(tokens, reference[batches[0]]),
                     "copy_pairs_differing": differing(copy_tokens[:half], copy_tokens[half:])})
        print(json.dumps(rows[-1]), flush=True)
        save()
    del plain
    for method in filter(None, args.methods.split(",")):
        name, _, budget = method.partition(":")
        llm = LLM(args.model, spec=name, draft=args.draft, budget=int(budget) if budget else None, **common)
        for batch in batches:
            n = len(reference[batch])
            tokens, seconds = run(llm, prompts[:n], batch, args.max_tokens)
            rows.append({"method": method, "batch": batch, "requests": n, "tokens": sum(map(len, tokens)),
                         "seconds": seconds, "differ_vs_plain": differing(tokens, reference[batch]),
                         "differ_vs_plain_batch_1": differing(tokens, reference[batches[0]][:n])})
            print(json.dumps(rows[-1]), flush=True)
            save()
        del llm
    exact = all(r.get(k, 0) == 0 for r in rows for k in ("differ_pass_to_pass", "differ_vs_batch_1",
                                                         "copy_pairs_differing", "differ_vs_plain",
                                                         "differ_vs_plain_batch_1"))
    print(f"exact = {'yes' if exact else 'NO'} over {sum(r['tokens'] for r in rows)} generated tokens")


if __name__ == "__main__":
    main()
