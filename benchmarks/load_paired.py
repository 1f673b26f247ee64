"""Paired load test: several running servers (e.g. plain, DDTree, DFlash on one GPU) measured in
alternation, so slow drift of the machine hits every server alike.

Two servers measured one after the other differ by the drift between their runs as well as by
what they do: on the H200 one server's passes spread by 4-15% (benchmarks/journal/session-06-2026-12-01.md,
"Serving under load, median of three passes") and the servers' ranges overlapped at every level. Here every
server stays up the whole time (idle ones sleep), and each repeat runs every level on every
server back to back, the server order rotating from repeat to repeat. Each method's pass is then
compared with the baseline's pass of the same repeat and level (a paired ratio); the report gives
the median paired ratio and its range, next to each server's median throughput.

    python benchmarks/load_paired.py --server none=http://127.0.0.1:8140/v1 \\
        --server ddtree=http://127.0.0.1:8141/v1 --model M --concurrency 1 4 16 32 \\
        --requests 12 --waves 4 --max-tokens 128 --ignore-eos --repeats 4 --out OUT

Per level a pass sends max(``--requests``, ``--waves`` x concurrency) streamed chat requests
(``load_test.run_level``: that many in flight at a time). Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import (add_client_processes_arg, add_prompts_arg, conversations, one_request, run_level,  # noqa: E402
                       write_report)


def parse_servers(entries: list[str]) -> dict[str, str]:
    servers = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"--server must be NAME=URL, got {entry!r}")
        if name in servers:
            raise SystemExit(f"--server name {name!r} given twice")
        servers[name] = url
    return servers


def level_args(args: argparse.Namespace, url: str, concurrency: int) -> argparse.Namespace:
    """load_test's arguments for one pass of one server at one level."""
    return argparse.Namespace(**{**vars(args), "base_url": url,
                                 "requests": max(args.requests, args.waves * concurrency)})


async def one_pass(clients: dict[str, openai.AsyncOpenAI], servers: dict[str, str], args, concurrency: int,
                   order: list[str]) -> dict[str, dict]:
    passes = {}
    for name in order:
        passes[name] = await run_level(clients[name], level_args(args, servers[name], concurrency), concurrency)
        level = passes[name]
        print(f"  {name:>8} concurrency {concurrency:>3}: {level['output_tokens_per_s']:8.1f} tok/s, TTFT p50 "
              f"{1000 * (level['ttft_s']['p50'] or 0):.0f} ms, errors {level['errors']}", flush=True)
    return passes


def summarize(passes: list[dict[str, dict]], baseline: str) -> dict:
    """One level over the repeats: per server its throughputs, TTFT p50s and rounds by node count,
    their medians, and the paired ratios to the baseline's pass of the same repeat."""
    names = list(passes[0])
    out = {}
    for name in names:
        tps = [p[name]["output_tokens_per_s"] for p in passes]
        ratios = [p[name]["output_tokens_per_s"] / p[baseline]["output_tokens_per_s"] for p in passes]
        out[name] = {
            "output_tokens_per_s_runs": tps, "output_tokens_per_s_median": statistics.median(tps),
            "ratio_to_baseline_runs": ratios, "ratio_to_baseline_median": statistics.median(ratios),
            "ratio_to_baseline_min": min(ratios), "ratio_to_baseline_max": max(ratios),
            "ttft_p50_s_runs": [p[name]["ttft_s"]["p50"] for p in passes],
            "itl_p50_s_runs": [p[name]["itl_s"]["p50"] for p in passes],
            "errors": sum(p[name]["errors"] for p in passes),
            "requests_per_pass": passes[0][name]["requests"],
            "rounds_by_nodes_runs": [p[name]["rounds_by_nodes"] for p in passes],
        }
    return out


def markdown(report: dict) -> str:
    baseline, names = report["baseline"], report["servers"]
    head = ["concurrency", *(f"{n} tok/s (median)" for n in names),
            *(f"{n} / {baseline}: median [min, max]" for n in names if n != baseline),
            *(f"{n} TTFT p50 ms" for n in names)]
    lines = [f"# Paired load test ({', '.join(names)}; baseline {baseline})", "", f"`{report['command']}`", "",
             f"{report['repeats']} repeats, each level run on every server back to back (order rotating); "
             f"max({report['requests']}, {report['waves']} x concurrency) streamed chat requests per pass, "
             f"max_tokens={report['max_tokens']}, ignore_eos={report['ignore_eos']}; client on {report['client']} "
             f"({report.get('client_processes', 1)} client processes).",
             "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for level in report["levels"]:
        by = level["by_server"]
        cells = [str(level["concurrency"])]
        cells += [f"{by[n]['output_tokens_per_s_median']:.1f}" for n in names]
        cells += [f"{by[n]['ratio_to_baseline_median']:.3f} [{by[n]['ratio_to_baseline_min']:.3f}, "
                  f"{by[n]['ratio_to_baseline_max']:.3f}]" for n in names if n != baseline]
        cells += ["/".join(f"{1000 * t:.0f}" if t is not None else "-" for t in by[n]["ttft_p50_s_runs"])
                  for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


async def run(args, servers: dict[str, str]) -> dict:
    names = list(servers)
    clients = {n: openai.AsyncOpenAI(base_url=u, api_key=args.api_key or "none", max_retries=0, timeout=args.timeout)
               for n, u in servers.items()}
    try:
        for name in names:
            await one_request(clients[name], level_args(args, servers[name], 1), [{"role": "user", "content": "Hello"}])
        for concurrency in args.concurrency:  # warm-up: graph captures and policy exploration happen here
            await one_pass(clients, servers, args, concurrency, names)
        print("warm-up done (every level on every server once, unmeasured)", flush=True)
        by_level: dict[int, list[dict[str, dict]]] = {c: [] for c in args.concurrency}
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            print(f"repeat {repeat + 1}/{args.repeats}, order {order}", flush=True)
            for concurrency in args.concurrency:
                by_level[concurrency].append(await one_pass(clients, servers, args, concurrency, order))
    finally:
        for client in clients.values():
            await client.close()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "servers": names, "baseline": args.baseline,
        "urls": servers, "model": args.model, "requests": args.requests, "waves": args.waves,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "repeats": args.repeats, "client_processes": args.client_processes,
        "client": f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "levels": [{"concurrency": c, "by_server": summarize(by_level[c], args.baseline)} for c in args.concurrency],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=BASE_URL (repeat; two at least)")
    parser.add_argument("--baseline", default=None, help="the server the others are compared with (default: the first)")
    parser.add_argument("--model", default="smollm2", help="the model name the servers serve")
    parser.add_argument("--api-key", default=os.environ.get("FLASHTREE_API_KEY"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=12, help="requests per pass, at least")
    parser.add_argument("--waves", type=int, default=4, help="requests per pass, at least this many x the concurrency")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (flashtree extension)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--repeats", type=int, default=4)
    add_client_processes_arg(parser)
    add_prompts_arg(parser)
    parser.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    args.conversations = conversations(args.prompts) if args.prompts else None
    if args.repeats < 1 or args.requests < 1 or args.waves < 1 or args.client_processes < 1:
        parser.error("--repeats, --requests, --waves and --client-processes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    servers = parse_servers(args.server)
    if len(servers) < 2:
        raise SystemExit("give at least two --server entries")
    args.baseline = args.baseline or next(iter(servers))
    if args.baseline not in servers:
        raise SystemExit(f"--baseline {args.baseline!r} is not one of the servers: {list(servers)}")
    report = asyncio.run(run(args, servers))
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
