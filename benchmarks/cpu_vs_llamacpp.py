"""CPU: flashtree (plain, and its default mode) against llama.cpp on the same GGUF file, side by side.

The same chat prompts' token ids (flashtree's chat template) go to every system; greedy, a fixed
number of new tokens (end of sequence ignored), the same thread count. Each (prompt, system) run is
a process of its own (``--worker``), so its peak resident memory is its own, and the systems take
turns prompt by prompt (the starting system rotates), so background load hits them alike. Reports
per system: decode tokens/s (new tokens after the first over the time after the first), prompt
processing tokens/s on a ``--pp-tokens`` prompt, peak RSS, the median over (prompt, repeat) of a
system's decode rate over another's on the same prompt run back to back (``decode_vs_*_paired``), and
per prompt the first position where a system's tokens differ from flashtree plain's (llama.cpp
quantizes activations to 8 bits in its quantized products, so its tokens may part from ours; the report
says where instead of hiding it).
llama.cpp comes from ``llama-cpp-python`` (the ``bench`` extra; never a default dependency).

    python benchmarks/cpu_vs_llamacpp.py --gguf smollm2 --out benchmarks/results/cpu_vs_llamacpp_smollm2_q4_1_epyc.json
    python benchmarks/cpu_vs_llamacpp.py --gguf smollm2 --requantize q8_0 --out ...q8_0...json

``--requantize q8_0`` writes the GGUF's Q8_0 twin with llama.cpp's quantizer first and compares on it
(flashtree's default mode is then plain decoding: the shipped drafter belongs to the embedded model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash map works and when to use one.",
           "What are three tips for staying focused while studying?",
           "Write a Python function that checks whether a string is a palindrome.",
           "Describe the water cycle to a ten-year-old.",
           "What is the difference between a list and a tuple in Python?",
           "Give me a recipe for a simple tomato soup.",
           "Summarize the plot of a detective story in five sentences."]
# flashtree_again: plain decoding once more, not in the default systems: with --systems
# flashtree,flashtree_again,flashtree_default its ratio to flashtree is the run's own noise floor (the same work twice)
SYSTEMS = ("flashtree", "flashtree_default", "llama.cpp")
EXTRA_SYSTEMS = ("flashtree_again",)
QUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # --requantize


def gguf_path(name: str) -> str:
    from flashtree.bench.llamacpp import gguf_file

    return str(gguf_file(name))


def requantize(gguf: str, kind: str) -> str:
    """The GGUF's ``kind`` twin next to the system's temporary files (made once)."""
    import ctypes
    import tempfile

    import llama_cpp

    out = Path(tempfile.gettempdir()) / f"{Path(gguf).stem}.{kind}.gguf"
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = getattr(llama_cpp, QUANT_TYPES[kind]), True
        if llama_cpp.llama_model_quantize(gguf.encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not quantize {gguf} to {kind}")
    return str(out)


def prompt_ids(gguf: str, index: int, pp_tokens: int) -> list[int]:
    """Prompt ``index`` through the chat template; index -1: a ``pp_tokens``-token prompt."""
    from flashtree.models.loader import load_checkpoint
    from flashtree.models.tokenizer import encode_chat

    tokenizer = load_checkpoint(gguf).tokenizer
    if index < 0:
        text = " ".join(PROMPTS) * 40
        return tokenizer.encode(text)[:pp_tokens]
    return encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[index]}])


def run_flashtree(model: str, ids: list[int], new_tokens: int, default_mode: bool, threads: int) -> dict:
    """``default_mode``: what ``flashtree generate`` runs (the embedded model: adaptive DDTree with the
    shipped drafter; another GGUF: plain decoding)."""
    import torch

    import flashtree

    torch.set_num_threads(threads)
    spec = "ddtree" if default_mode and model == "smollm2" else "none"
    llm = flashtree.LLM(model, spec=spec, device="cpu", max_running=1, max_context=len(ids) + new_tokens + 8)
    engine = llm.engine
    warm = engine.add_request(ids[:8], flashtree.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run_until_done([warm])
    engine.rounds_by_nodes.clear()
    req = engine.add_request(ids, flashtree.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    while not req.output_ids:
        engine.step()
    t1 = time.perf_counter()
    engine.run_until_done([req])
    t2 = time.perf_counter()
    tree_rounds = sum(count for nodes, count in engine.rounds_by_nodes.items() if nodes)
    return {"tokens": req.output_ids, "prefill_s": t1 - t0, "decode_s": t2 - t1, "tree_rounds": tree_rounds}


def run_llamacpp(gguf: str, ids: list[int], new_tokens: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(ids) + new_tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(ids[:8])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    token = llm.sample(top_k=1, temp=0.0, repeat_penalty=1.0)
    t1 = time.perf_counter()
    tokens = [token]
    while len(tokens) < new_tokens:
        llm.eval([token])
        token = llm.sample(top_k=1, temp=0.0, repeat_penalty=1.0)
        tokens.append(token)
    t2 = time.perf_counter()
    return {"tokens": [int(t) for t in tokens], "prefill_s": t1 - t0, "decode_s": t2 - t1}


def worker(args) -> None:
    ids = prompt_ids(args.gguf, args.prompt, args.pp_tokens)
    new_tokens = 1 if args.prompt < 0 else args.new_tokens
    if args.worker == "llama.cpp":
        out = run_llamacpp(args.gguf, ids, new_tokens, args.threads)
    else:
        out = run_flashtree(args.model, ids, new_tokens, args.worker == "flashtree_default", args.threads)
    out.update(prompt_tokens=len(ids), peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(out))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default="smollm2", help="a GGUF file, or smollm2 (the embedded default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pp-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated, of: " + ", ".join(SYSTEMS + EXTRA_SYSTEMS))
    parser.add_argument("--requantize", choices=tuple(QUANT_TYPES),
                        help="compare on the GGUF's twin of this type (made with llama.cpp's quantizer)")
    parser.add_argument("--policy-memory", help="the default mode's policy memory directory (default: the "
                                                "user's, as `flashtree generate` reads it; a fresh directory "
                                                "makes the run's first default process explore)")
    parser.add_argument("--out")
    parser.add_argument("--worker", choices=SYSTEMS + EXTRA_SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.gguf  # what flashtree loads (smollm2: the embedded model, with its drafter)
    args.gguf = gguf_path(args.gguf)
    if args.requantize and not args.worker:
        args.model = args.gguf = requantize(args.gguf, args.requantize)
    if args.worker:
        worker(args)
        return
    systems = tuple(s for s in SYSTEMS + EXTRA_SYSTEMS if s in args.systems.split(","))
    runs = []
    for repeat in range(args.repeats):
        for prompt in [-1, *range(len(PROMPTS))]:
            turn = (prompt + repeat) % len(systems)
            order = systems[turn:] + systems[:turn]
            for system in order:
                command = [sys.executable, __file__, "--gguf", args.model, "--threads", str(args.threads),
                           "--new-tokens", str(args.new_tokens), "--pp-tokens", str(args.pp_tokens),
                           "--worker", system, "--prompt", str(prompt)]
                env = {**os.environ, "FLASHTREE_POLICY_CACHE": args.policy_memory} if args.policy_memory else None
                done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
                runs.append({"system": system, "prompt": prompt, "repeat": repeat,
                             **json.loads(done.stdout.strip().splitlines()[-1])})
                print(system, prompt, {k: v for k, v in runs[-1].items() if k != "tokens"}, flush=True)
    summary = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        decode = [(len(r["tokens"]) - 1) / r["decode_s"] for r in mine if r["prompt"] >= 0]
        pp = [r["prompt_tokens"] / r["prefill_s"] for r in mine if r["prompt"] < 0]
        summary[system] = {"decode_tok_s": statistics.median(decode), "pp_tok_s": statistics.median(pp),
                           "peak_rss_mib": max(r["peak_rss_mib"] for r in mine)}
        if system != "llama.cpp":  # (drafted rounds per decode run: the default mode's probes)
            summary[system]["tree_rounds"] = [r["tree_rounds"] for r in mine if r["prompt"] >= 0]
    plain = {(r["prompt"], r["repeat"]): r["tokens"] for r in runs if r["system"] == "flashtree" and r["prompt"] >= 0}
    for system in systems:
        summary[system]["first_difference_from_flashtree_plain"] = [
            first_difference(r["tokens"], plain[(r["prompt"], r["repeat"])]) for r in runs
            if r["system"] == system and r["prompt"] >= 0]
    rate = {(r["system"], r["prompt"], r["repeat"]): (len(r["tokens"]) - 1) / r["decode_s"] for r in runs
            if r["prompt"] >= 0}
    for reference in ("llama.cpp", "flashtree"):  # (--systems may leave either out)
        if reference in summary:
            for system in systems:
                summary[system][f"decode_vs_{reference}"] = (summary[system]["decode_tok_s"]
                                                             / summary[reference]["decode_tok_s"])
                # the same prompt and repeat, run back to back: steadier on a machine whose speed drifts
                summary[system][f"decode_vs_{reference}_paired"] = statistics.median(
                    rate[(system, p, rep)] / rate[(reference, p, rep)] for (s, p, rep) in rate if s == system)
    out = {"cpu": platform.processor() or platform.machine(), "gguf": args.gguf, "threads": args.threads,
           "new_tokens": args.new_tokens, "pp_tokens": args.pp_tokens, "policy_memory": args.policy_memory,
           "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
