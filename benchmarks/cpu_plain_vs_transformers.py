"""CPU, 2 threads: flashtree plain decoding vs transformers ``generate`` on SmolLM2-135M-Instruct.

Three systems, all on the SAME fp32 weights: flashtree as shipped (decode-sized products read
the GGUF's Q4_1 / Q8_0 blocks with the AVX-512 block kernel, models/cpu_quant_linear.py),
transformers loading the Hugging Face directory flashtree's GGUF loader converted, and flashtree
with ``quant_kernels=False`` (every product on the dequantized fp32 weights). Greedy, fp32,
batch 1, a fixed number of new tokens (end-of-sequence ignored) for a few chat prompts. The
systems alternate prompt by prompt and repeat by repeat (so background load hits all alike),
every prompt runs ``--repeats`` times per system, and the tokens must match.

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


SYSTEMS = ("flashtree", "transformers", "flashtree_fp32")  # flashtree_fp32: --no-quant-kernels


def load_systems(max_context: int):
    import transformers

    import flashtree
    from flashtree.models.loader import load_checkpoint

    options = dict(device="cpu", dtype="float32", max_running=1, max_context=max_context)
    llm = flashtree.LLM("smollm2", **options)
    if llm.engine.model.lm_head_quant is None:
        raise SystemExit("the block kernel is not in use here (see the log line above); nothing to compare")
    llm_fp32 = flashtree.LLM("smollm2", quant_kernels=False, **options)
    checkpoint_dir = load_checkpoint("smollm2").path
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # fixed-length generation, as with ignore_eos
    return llm, hf, llm_fp32, checkpoint_dir


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


def measure(llm, hf, llm_fp32, prompts_ids, new_tokens: int, repeats: int) -> list[dict]:
    runs = {"flashtree": lambda ids: run_flashtree(llm, ids, new_tokens),
            "transformers": lambda ids: run_transformers(hf, ids, new_tokens),
            "flashtree_fp32": lambda ids: run_flashtree(llm_fp32, ids, new_tokens)}
    rows = []
    for index, prompt_ids in enumerate(prompts_ids):
        times = {name: [] for name in SYSTEMS}
        tokens = {}
        for _ in range(repeats):
            for name in SYSTEMS:
                tokens[name], seconds = runs[name](prompt_ids)
                times[name].append(seconds)
        ours, theirs, fp32 = (tokens[name] for name in SYSTEMS)
        rows.append({"prompt": index, "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
                     "tokens_match": ours == theirs == fp32, "first_mismatch": first_mismatch(ours, theirs),
                     "first_mismatch_fp32": first_mismatch(ours, fp32),
                     **{f"{name}_seconds": times[name] for name in SYSTEMS}})
        rates = ", ".join(f"{name} {new_tokens / min(times[name]):.1f}" for name in SYSTEMS)
        print(f"prompt {index}: tok/s (best) {rates}; tokens match {ours == theirs == fp32}", flush=True)
    return rows


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def summarize(rows: list[dict], new_tokens: int) -> dict:
    def rate(key: str, pick) -> float:
        return new_tokens * len(rows) / sum(pick(r[key]) for r in rows)

    summary = {}
    for name in SYSTEMS:
        summary[name] = {"tokens_per_s_median": round(rate(f"{name}_seconds", statistics.median), 2),
                         "tokens_per_s_best": round(rate(f"{name}_seconds", min), 2)}
    for name in ("flashtree", "flashtree_fp32"):
        suffix = "" if name == "flashtree" else "_fp32"
        for stat in ("median", "best"):
            summary[f"speedup{suffix}_{stat}"] = round(summary[name][f"tokens_per_s_{stat}"]
                                                       / summary["transformers"][f"tokens_per_s_{stat}"], 3)
    summary["all_tokens_match"] = all(r["tokens_match"] for r in rows)
    return summary


LABELS = {"flashtree": "flashtree (block kernel, as shipped)", "transformers": "transformers `generate`",
          "flashtree_fp32": "flashtree --no-quant-kernels (fp32)"}


def print_table(summary: dict) -> None:
    base = summary["transformers"]
    print("| system | tokens/s (median) | tokens/s (best) | vs transformers (median) | vs transformers (best) |")
    print("| --- | --- | --- | --- | --- |")
    for name in SYSTEMS:
        median, best = summary[name]["tokens_per_s_median"], summary[name]["tokens_per_s_best"]
        print(f"| {LABELS[name]} | {median:.1f} | {best:.1f} | {median / base['tokens_per_s_median']:.2f}x "
              f"| {best / base['tokens_per_s_best']:.2f}x |")
    print(f"tokens match (all three, every prompt): {summary['all_tokens_match']}")


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

    llm, hf, llm_fp32, checkpoint_dir = load_systems(max_context=1024)
    prompts_ids = [encode_chat(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    run_flashtree(llm, prompts_ids[0], 8)  # warm-up, untimed
    run_transformers(hf, prompts_ids[0], 8)
    run_flashtree(llm_fp32, prompts_ids[0], 8)
    rows = measure(llm, hf, llm_fp32, prompts_ids, args.new_tokens, args.repeats)
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
