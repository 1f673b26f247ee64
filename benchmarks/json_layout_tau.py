"""How the JSON layout a grammar forces changes speculation (CPU, SmolLM2 pair): the same schema
prompts under xgrammar with compact JSON, JSON indented by 2 (flashtree's layout) and bounded free
whitespace, for plain, DDTree-4 and DFlash; tokens/s of one timed pass after a warm-up request,
the mean acceptance length (tau), and how many answers validate. The layout is switched by wrapping
xgrammar's ``compile_json_schema``, so nothing else changes.

    python benchmarks/json_layout_tau.py --out benchmarks/results/json_layout_tau_smollm2_epyc_2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from structured_output import SCHEMA, chats, valid  # noqa: E402

LAYOUTS = {"compact": {"any_whitespace": False, "indent": None},
           "indent_2": {"any_whitespace": False, "indent": 2},
           "free_whitespace_16": {"any_whitespace": True, "indent": None, "max_whitespace_cnt": 16}}
METHODS = [("none", None), ("ddtree", 4), ("dflash", None)]


def run(layout: str, method: str, budget: int | None, prompts: int, new_tokens: int) -> dict:
    import xgrammar

    import flashtree
    from flashtree.structured import StructuredOutput

    original = xgrammar.GrammarCompiler.compile_json_schema

    def compile_with_layout(self, schema, **settings):
        return original(self, schema, **{**settings, **LAYOUTS[layout]})

    xgrammar.GrammarCompiler.compile_json_schema = compile_with_layout
    try:
        llm = flashtree.LLM("smollm2", spec=method, budget=budget, adaptive_spec=False, max_context=1024)
        params = flashtree.SamplingParams(max_tokens=new_tokens, structured=StructuredOutput.json_schema(SCHEMA))
        llm.chat(chats()[0], params)  # warm-up
        start, outs = time.perf_counter(), [llm.chat(c, params)[0] for c in chats()[:prompts]]
        seconds = time.perf_counter() - start
    finally:
        xgrammar.GrammarCompiler.compile_json_schema = original
    rounds = sum(o.rounds for o in outs)
    return {"layout": layout, "method": method, "budget": budget,
            "tok_s": round(sum(len(o.token_ids) for o in outs) / seconds, 1),
            "tau": round(sum(sum(o.acceptance_lengths) for o in outs) / rounds, 3) if rounds else None,
            "valid": sum(valid(o.text) for o in outs), "outputs": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from flashtree.bench.environment import cpu_name

    rows = []
    for layout in LAYOUTS:
        for method, budget in METHODS:
            rows.append(run(layout, method, budget, args.prompts, args.new_tokens))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    for row in rows:
        plain = next(r for r in rows if r["layout"] == row["layout"] and r["method"] == "none")
        row["equals_plain"], row["vs_plain"] = row["outputs"] == plain["outputs"], round(row["tok_s"] / plain["tok_s"], 3)
    for row in rows:
        del row["outputs"]
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "prompts": args.prompts,
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
