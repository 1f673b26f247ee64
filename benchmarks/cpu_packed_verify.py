"""CPU: rounds with per-row budgets verifying their rows packed (``packed_verify`` None, the default: budgets by
the policy's cost curve) against padded to the widest row (``--no-packed-verify``) and against fixed packed totals
(``--packed-verify``: n nodes per row -> rows x (n + 1) tokens from trees of up to 4n), the rest of the engine alike.

Engines of the default mode (the embedded SmolLM2 with its shipped drafter, adaptive DDTree, which
allots each drafted round's nodes among its rows) decode the same ``--rows`` prompts together, ``--new-tokens``
greedy tokens each (end of sequence ignored), taking turns pass by pass (``--passes``; the first system of a
pass tends to run a few percent faster than the later ones, so each system takes every place in turn). Per
pass: wall seconds, output tokens/s, drafted rounds, the mean tokens a drafted round verified (packed: the
flat batch; padded: rows x the widest row) and whether every engine's tokens equal a plain engine's (they
must: every layout is lossless). The first pass after start-up is reported
first; the engines' policies learn across passes.

    python benchmarks/cpu_packed_verify.py --rows 8 --passes 4 --out benchmarks/results/FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_default_mode import COUNTING_PROMPTS  # noqa: E402
from cpu_vs_llamacpp import PROMPTS as CHAT_PROMPTS  # noqa: E402
from tree_build_speed import device_name  # noqa: E402

SYSTEMS = ("packed", "padded", "fixed_packed")
PACKED_VERIFY = {"packed": None, "padded": False, "fixed_packed": True}


class VerifiedTokens:
    """Counts drafted rounds and the tokens their verify forwards ran (wraps the target's forward)."""

    def __init__(self, model):
        self.rounds, self.tokens = 0, 0
        self._forward = model.forward
        model.forward = self

    def __call__(self, batch, cache, *args, **kwargs):
        if not batch.prefill and batch.num_new > 1:  # (a tree round's verify forward; prefill and plain steps not)
            self.rounds += 1
            self.tokens += batch.packing.total if batch.packing is not None else batch.input_ids.numel()
        return self._forward(batch, cache, *args, **kwargs)


def engine(system: str, rows: int):
    import flashtree

    llm = flashtree.LLM("smollm2", spec="none" if system == "plain" else "ddtree", device="cpu", max_running=rows,
                        packed_verify=PACKED_VERIFY.get(system))
    return llm, VerifiedTokens(llm.engine.model) if system != "plain" else None


def one_pass(llm, counter, prompts, new_tokens: int) -> dict:
    from flashtree import SamplingParams

    before = (counter.rounds, counter.tokens) if counter else (0, 0)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    rounds = (counter.rounds - before[0]) if counter else 0
    tokens = (counter.tokens - before[1]) if counter else 0
    return {"seconds": seconds, "tok_s": sum(len(o.token_ids) for o in outs) / seconds, "drafted_rounds": rounds,
            "verified_tokens_per_drafted_round": tokens / rounds if rounds else None,
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--workload", choices=["chat", "counting"], default="chat")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from flashtree.models.tokenizer import encode_chat

    base = CHAT_PROMPTS if args.workload == "chat" else COUNTING_PROMPTS
    plain, _ = engine("plain", args.rows)
    prompts = [encode_chat(plain.tokenizer, [{"role": "user", "content": base[i % len(base)]}])
               for i in range(args.rows)]
    reference = one_pass(plain, None, prompts, args.new_tokens)["tokens"]
    engines = {system: engine(system, args.rows) for system in SYSTEMS}
    passes = {system: [] for system in SYSTEMS}
    for index in range(args.passes):
        for system in SYSTEMS[index % len(SYSTEMS):] + SYSTEMS[:index % len(SYSTEMS)]:  # (each system first in turn)
            result = one_pass(*engines[system], prompts, args.new_tokens)
            result["same_tokens_as_plain"] = result.pop("tokens") == reference
            passes[system].append(result)
            print(system, index, {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}, flush=True)
    summary = {system: {"first_pass_tok_s": runs[0]["tok_s"],
                        "median_tok_s_after_first": statistics.median(r["tok_s"] for r in runs[1:]) if runs[1:] else None,
                        "all_same_tokens_as_plain": all(r["same_tokens_as_plain"] for r in runs)}
               for system, runs in passes.items()}
    record = {"benchmark": "cpu_packed_verify", "cpu": platform.processor() or platform.machine(),
              "cpu_model": device_name(torch.device("cpu")), "threads": args.threads, "rows": args.rows, "workload": args.workload,
              "new_tokens": args.new_tokens, "passes": passes, "summary": summary,
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
