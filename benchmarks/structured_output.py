"""Structured output on the CPU: what a JSON schema costs and keeps of speculation, per method and
grammar backend, and whether every answer parses and validates.

On the embedded SmolLM2 pair (2 threads, greedy unless said), for each method (plain, DFlash,
DDTree-4, DDTree-16) and each grammar backend: the same chat prompts answered freely and under a
JSON schema, batch 1, one engine per configuration; tokens/s of the first timed pass (after one
warm-up request) with a second pass beside it, the mean acceptance length (tau) and whether the
constrained tokens equal plain constrained decoding. Then ``--validity`` requests under the schema,
sampled at temperature 0.8 with their own seeds, batched 8 at a time by the DDTree engine: how many
parse and validate (finish "stop"; a "length" finish is counted apart).

    python benchmarks/structured_output.py --out benchmarks/results/structured_output_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "skills"],
          "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 32},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4}}}
SUBJECTS = ["a nurse in Lisbon", "a retired pilot", "a young chess champion", "a baker who loves jazz",
            "a software engineer who writes Rust", "a marine biologist", "a high school history teacher",
            "a farmer in Kenya", "an architect in Tokyo", "a startup founder", "a librarian", "a mountain guide"]
METHODS = [("none", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16)]


def chats() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe {s} as JSON with name, age, city and skills."}] for s in SUBJECTS]


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    props = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(props) and isinstance(value["name"], str)
            and len(value["name"]) <= 32 and isinstance(value["age"], int) and isinstance(value["city"], str)
            and len(value["city"]) <= 32 and isinstance(value["skills"], list) and len(value["skills"]) <= 4
            and all(isinstance(s, str) and len(s) <= 24 for s in value["skills"]))


def timed_pass(llm, conversations, params) -> dict:
    """One request at a time (batch 1): tokens/s over the pass, tau, outputs."""
    tokens = rounds = committed = 0
    outputs = []
    start = time.perf_counter()
    for conversation in conversations:
        out = llm.chat(conversation, params)[0]
        outputs.append(out)
        tokens += len(out.token_ids)
        rounds += out.rounds
        committed += sum(out.acceptance_lengths)
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "tau": committed / rounds if rounds else 0.0, "tokens": tokens,
            "outputs": [o.token_ids for o in outputs], "texts": [o.text for o in outputs]}


def configuration(method: str, budget: int | None, backend: str, constrained: bool, new_tokens: int) -> dict:
    import flashtree
    from flashtree.structured import StructuredOutput

    llm = flashtree.LLM("smollm2", spec=method, budget=budget, adaptive_spec=False, max_running=8,
                        max_context=1024, grammar_backend=backend)
    structured = StructuredOutput.json_schema(SCHEMA) if constrained else None
    params = flashtree.SamplingParams(max_tokens=new_tokens, structured=structured)
    conversations = chats()
    llm.chat(conversations[0], params)  # warm-up (compiles the schema once)
    first, second = timed_pass(llm, conversations, params), timed_pass(llm, conversations, params)
    return {"method": method, "budget": budget, "backend": backend, "constrained": constrained,
            "first_tok_s": round(first["tok_s"], 1), "second_tok_s": round(second["tok_s"], 1),
            "tau": round(first["tau"], 3), "valid": sum(valid(t) for t in first["texts"]) if constrained else None,
            "outputs": first["outputs"]}


def validity(count: int, backend: str, new_tokens: int) -> dict:
    """``count`` sampled requests under the schema (``new_tokens`` is room enough for the longest)."""
    import flashtree
    from flashtree.structured import StructuredOutput

    llm = flashtree.LLM("smollm2", spec="ddtree", max_running=8, max_context=1024, grammar_backend=backend)
    schema = StructuredOutput.json_schema(SCHEMA)
    conversations = [chats()[i % len(SUBJECTS)] for i in range(count)]
    params = [flashtree.SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=1000 + i, structured=schema)
              for i in range(count)]
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    stopped = [o for o in outs if o.finish_reason == "stop"]
    return {"requests": count, "backend": backend, "stopped": len(stopped), "valid": sum(valid(o.text) for o in stopped),
            "length_finishes": sum(o.finish_reason == "length" for o in outs), "seconds": round(seconds, 1),
            "tok_s": round(sum(len(o.token_ids) for o in outs) / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--backends", default="xgrammar,llguidance")
    parser.add_argument("--validity", type=int, default=500, help="requests in the validity run (0: none)")
    parser.add_argument("--validity-tokens", type=int, default=256,
                        help="max_tokens in the validity run: room for the schema's longest answer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from flashtree.bench.environment import cpu_name

    rows = []
    for backend in args.backends.split(","):
        for method, budget in METHODS:
            for constrained in (False, True):
                if not constrained and backend != args.backends.split(",")[0]:
                    continue  # (free text does not depend on the backend)
                row = configuration(method, budget, backend, constrained, args.new_tokens)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
    for row in rows:  # lossless: each method's constrained tokens are plain's (same backend)
        plain = next(r for r in rows if r["method"] == "none" and r["backend"] == row["backend"]
                     and r["constrained"] == row["constrained"])
        row["equals_plain"] = row["outputs"] == plain["outputs"]
        row["vs_plain"] = round(row["first_tok_s"] / plain["first_tok_s"], 3)  # same outputs: a fair ratio
    runs = [validity(args.validity, backend, args.validity_tokens) for backend in args.backends.split(",")[:1]
            if args.validity]
    for run in runs:
        print(json.dumps(run), flush=True)
    result = {"cpu": cpu_name() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
              "new_tokens": args.new_tokens, "prompts": len(SUBJECTS), "schema": SCHEMA,
              "configurations": [{k: v for k, v in r.items() if k != "outputs"} for r in rows], "validity": runs,
              "median_free_tok_s": statistics.median(r["first_tok_s"] for r in rows if not r["constrained"])}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
