"""CPU, 2 threads: flashtree plain decoding vs transformers ``generate`` on SmolLM2-135M-Instruct.

Both load the SAME dequantized weights: flashtree's GGUF loader caches the converted model as a
Hugging Face directory (safetensors + config + tokenizer) and transformers loads that directory.
Greedy, fp32, batch 1, a fixed number of new tokens (end-of-sequence ignored) for a few chat
prompts. The two systems alternate prompt by prompt (so background load hits both alike), every
prompt runs ``--repeats`` times per system, and the tokens must match.

    python benchmarks/cpu_plain_vs_transformers.py [--new-tokens 128] [--repeats 3]

Writes benchmarks/results/cpu_plain_vs_transformers.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works and when to use one.",
    "What are three tips for staying focused while studying?",
    "Write a Python function that checks whether a string is a palindrome.",
]
RESULTS = Path(__file__).resolve().parent / "results" / "cpu_plain_vs_transformers.json"


def load_systems(max_context: int):
    import transformers

    import flashtree
    from flashtree.models.loader import load_checkpoint

    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=max_context)
    checkpoint_dir = load_checkpoint("smollm2").path
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # fixed-length generation, as with ignore_eos
    return llm, hf, checkpoint_dir


def run_flashtree(llm, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    from flashtree import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    return out.token_ids, time.perf_counter() - start


@torch.inference_mode()
def run_transformers(hf, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start


def measure(llm, hf, prompts_ids, new_tokens: int, repeats: int) -> list[dict]:
    rows = []
    for index, prompt_ids in enumerate(prompts_ids):
        ours_times, theirs_times = [], []
        for _ in range(repeats):
            ours, seconds = run_flashtree(llm, prompt_ids, new_tokens)
            ours_times.append(seconds)
            theirs, seconds = run_transformers(hf, prompt_ids, new_tokens)
            theirs_times.append(seconds)
        rows.append({"prompt": index, "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
                     "tokens_match": ours == theirs, "first_mismatch": first_mismatch(ours, theirs),
                     "flashtree_seconds": ours_times, "transformers_seconds": theirs_times})
        print(f"prompt {index}: flashtree {new_tokens / min(ours_times):.1f} tok/s, "
              f"transformers {new_tokens / min(theirs_times):.1f} tok/s, match {ours == theirs}", flush=True)
    return rows


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def summarize(rows: list[dict], new_tokens: int) -> dict:
    def rate(key: str, pick) -> float:
        return new_tokens * len(rows) / sum(pick(r[key]) for r in rows)

    summary = {}
    for name in ("flashtree", "transformers"):
        summary[name] = {"tokens_per_s_median": round(rate(f"{name}_seconds", statistics.median), 2),
                         "tokens_per_s_best": round(rate(f"{name}_seconds", min), 2)}
    summary["speedup_median"] = round(summary["flashtree"]["tokens_per_s_median"]
                                      / summary["transformers"]["tokens_per_s_median"], 3)
    summary["speedup_best"] = round(summary["flashtree"]["tokens_per_s_best"]
                                    / summary["transformers"]["tokens_per_s_best"], 3)
    summary["all_tokens_match"] = all(r["tokens_match"] for r in rows)
    return summary


def print_table(summary: dict) -> None:
    print("| system | tokens/s (median) | tokens/s (best) |")
    print("| --- | --- | --- |")
    for name in ("flashtree", "transformers"):
        print(f"| {name} | {summary[name]['tokens_per_s_median']:.1f} | {summary[name]['tokens_per_s_best']:.1f} |")
    print(f"| speedup | {summary['speedup_median']:.2f}x | {summary['speedup_best']:.2f}x |")
    print(f"tokens match: {summary['all_tokens_match']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from flashtree.bench.environment import environment
    from flashtree.tokenizer import encode_chat

    llm, hf, checkpoint_dir = load_systems(max_context=1024)
    prompts_ids = [encode_chat(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    run_flashtree(llm, prompts_ids[0], 8)  # warm-up, untimed
    run_transformers(hf, prompts_ids[0], 8)
    rows = measure(llm, hf, prompts_ids, args.new_tokens, args.repeats)
    summary = summarize(rows, args.new_tokens)
    config = {**environment(torch.device("cpu")), "model": "smollm2", "checkpoint_dir": str(checkpoint_dir),
              "dtype": "float32", "batch_size": 1, "greedy": True, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "threads": args.threads, "prompts": PROMPTS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "summary": summary, "prompts": rows}, indent=2) + "\n")
    print_table(summary)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
