"""CPU: a dense float32 target (SmolLM2's weights as a plain checkpoint, no GGUF blocks) with its products held
by the block kernel over the float32 weights (the default, ``quant_kernels``) against F.linear
(``--no-quant-kernels``): decode tokens/s, a 512-token prompt's time (three runs; with the holders also with the
kernel in prompt chunks, which take F.linear by default), and whether DDTree-16 / DDTree-64 give plain
decoding's tokens in each (F.linear's rows change bits with the row count; the kernel's never do).

    python benchmarks/cpu_dense_float32_rows.py --out benchmarks/results/cpu_dense_float32_rows_epyc_2026-12-06.json

The dense checkpoint is the embedded GGUF's own conversion with its GGUF source removed from config.json.
Engines alternate prompt by prompt; greedy, ``--new-tokens`` per prompt, fresh engines per variant.
"""

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
import unittest.mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import load_prompts
from flashtree.kernels.cpu.quant_linear import Float32Rows, QuantizedLinear
from flashtree.models.loader import load_checkpoint
from flashtree.speculative.defaults import shipped_drafter


def dense_copy(workdir: Path) -> Path:
    """The embedded model's conversion as a dense float32 checkpoint (links to its files)."""
    source = Path(load_checkpoint("smollm2").path)
    target = workdir / "smollm2-dense"
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "gguf_blocks.safetensors") and not (target / item.name).exists():
            (target / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config.pop("flashtree_source_gguf", None)
    (target / "config.json").write_text(json.dumps(config))
    return target


def prompt_seconds(llm, runs: int = 3) -> list[float]:
    """Seconds of a 512-token prompt and one new token, ``runs`` times in a row (the first is the first pass)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate([list(range(1000, 1512))], SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/flashtree-dense")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = str(dense_copy(Path(args.workdir)))
    prompts = [p.messages for p in load_prompts("sharegpt-heldout", args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    engine = {"device": "cpu", "adaptive_spec": False, "max_running": 1, "max_context": 1024}
    variants = {"kernel": {}, "f_linear": {"quant_kernels": False}}
    plain = {name: LLM(model, **engine, **kw) for name, kw in variants.items()}
    rows = {name: {"decode_tok_s": [], "tokens": []} for name in variants}
    for prompt in prompts:
        for name, llm in plain.items():
            start = time.perf_counter()
            out = llm.chat([prompt], params)[0]
            rows[name]["decode_tok_s"].append(len(out.token_ids) / (time.perf_counter() - start))
            rows[name]["tokens"].append(out.token_ids)
    for name, llm in plain.items():
        rows[name]["prompt_512_s_runs"] = prompt_seconds(llm)
    with unittest.mock.patch.object(Float32Rows, "__call__", QuantizedLinear.__call__):  # the kernel in prompts too
        rows["kernel"]["prompt_512_s_runs_kernel_in_prompt_chunks"] = prompt_seconds(plain["kernel"])
    for name, kw in variants.items():
        for budget in (16, 64):
            tree = LLM(model, spec="ddtree", draft=str(shipped_drafter("smollm2")), budget=budget, **engine, **kw)
            tokens = [o.token_ids for o in tree.chat(prompts, params)]
            rows[name][f"ddtree_{budget}_prompts_differing_from_plain"] = sum(
                a != b for a, b in zip(tokens, rows[name]["tokens"]))
    summary = {name: {"decode_tok_s_median": statistics.median(r["decode_tok_s"]),
                      **{k: v for k, v in r.items() if k.startswith(("ddtree", "prompt"))}} for name, r in rows.items()}
    summary["same_plain_tokens_both_ways"] = rows["kernel"]["tokens"] == rows["f_linear"]["tokens"]
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": platform.processor() or platform.machine(),
                                          "threads": torch.get_num_threads(), "summary": summary, "rows": rows},
                                         indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
