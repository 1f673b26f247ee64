"""Load generator for a running flashtree (or any OpenAI-compatible) server.

For each concurrency level it keeps that many streamed chat requests in flight until
max(``--requests``, concurrency) have finished, and reports, with mean, p50, p90 and p99:
- throughput: output tokens and requests per second of wall time;
- TTFT: time to first token (sending -> first content chunk);
- ITL: inter-token latency, the gap between streamed chunks (one chunk per engine step, so
  with speculative decoding a chunk can carry several tokens);
- TPOT: time per output token, a request's decode time over its tokens after the first;
- E2E: end-to-end latency; and tau, the mean acceptance length reported in ``usage``;
- rounds by nodes: the server's batched rounds per drafted node count during the level (from
  ``/metrics``; what adaptive speculation chose; 0 = plain rounds), when the server has them.
Writes ``OUT.json`` and ``OUT.md``. ``benchmarks/load_cpu.sh`` is a complete CPU run:

    flashtree serve --model smollm2 --spec none --max-running 32 --max-context 512 &
    python benchmarks/load_test.py --model smollm2 --concurrency 1 4 16 32 --requests 4 \\
        --max-tokens 32 --ignore-eos --out benchmarks/results/load_cpu_smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
    "Name five animals that live in the ocean.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What are the main causes of inflation?",
    "Describe how a hash table works.",
    "Translate 'good morning, how are you?' into Spanish.",
    "List the planets of the solar system in order.",
    "What is a prime number? Give examples.",
    "Suggest a name for a bakery and explain it.",
)


@dataclasses.dataclass(frozen=True)
class RequestResult:
    ok: bool
    error: str | None
    ttft: float | None  # seconds from sending to the first content chunk
    itls: tuple[float, ...]  # gaps between content chunks
    e2e: float
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    mean_acceptance_length: float

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


async def one_request(client: openai.AsyncOpenAI, args, messages: list[dict]) -> RequestResult:
    start = time.perf_counter()
    first = last = None
    itls: list[float] = []
    usage = None
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    try:
        stream = await client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as err:
        return RequestResult(False, f"{type(err).__name__}: {err}", None, (), time.perf_counter() - start, 0, 0, 0, 0.0)
    end = time.perf_counter()
    return RequestResult(
        True, None, None if first is None else first - start, tuple(itls), end - start,
        usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
        getattr(usage, "rounds", 0) or 0, getattr(usage, "mean_acceptance_length", 0.0) or 0.0)


async def run_level(client: openai.AsyncOpenAI, args, concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight until max(``args.requests``, concurrency) are done;
    with ``args.client_processes`` > 1 they are shared out over that many client processes."""
    source = getattr(args, "conversations", None) or [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = [source[i % len(source)] for i in range(max(args.requests, concurrency))]  # each a message list
    before = await rounds_by_nodes(args.base_url)
    if getattr(args, "client_processes", 1) > 1:
        results, start, end = await _drive_in_processes(args, prompts, concurrency)
    else:
        results, start, end = await _drive(client, args, prompts, concurrency)
    level = summarize(concurrency, results, end - start)
    level["load_average_1m"] = os.getloadavg()[0]  # this machine's load at the end (shared hosts are noisy)
    after = await rounds_by_nodes(args.base_url)
    level["rounds_by_nodes"] = None if after is None else {
        n: count - (before or {}).get(n, 0) for n, count in after.items() if count > (before or {}).get(n, 0)}
    return level


async def _drive(client: openai.AsyncOpenAI, args, prompts: list[list[dict]], concurrency: int
                 ) -> tuple[list[RequestResult], float, float]:
    """``prompts`` sent with ``concurrency`` in flight; the results and the start and end times."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await one_request(client, args, queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return results, start, time.perf_counter()


# Client processes (--client-processes): one Python process reading every stream parses each SSE
# event (httpx + the openai client's pydantic models, tens of microseconds each); at thousands of
# events per second it can become what a test measures. Each process keeps its own event loop
# and one client per server (connections stay open between levels).
_POOL: concurrent.futures.ProcessPoolExecutor | None = None
_WORKER_LOOP: asyncio.AbstractEventLoop | None = None
_WORKER_CLIENTS: dict[str, openai.AsyncOpenAI] = {}
START_DELAY_S = 0.2  # the processes start their share together, this long after it was sent


def _pool(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers != processes:
        _POOL = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    return _POOL


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` dealt round robin into ``parts`` lists (the first ones one longer)."""
    return [items[i::parts] for i in range(parts)]


async def _drive_in_processes(args, prompts: list[list[dict]], concurrency: int) -> tuple[list[RequestResult], float, float]:
    """:func:`_drive` shared out over ``args.client_processes`` processes: each keeps its share of
    ``concurrency`` in flight over its share of ``prompts``, all starting at one moment (the
    monotonic clock is the machine's, so the processes' times compare)."""
    processes = min(args.client_processes, concurrency)
    pool = _pool(args.client_processes)
    shares = [len(share) for share in split_evenly(list(range(concurrency)), processes)]
    start_at = time.perf_counter() + START_DELAY_S
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    futures = [asyncio.wrap_future(pool.submit(_process_share, settings, share_prompts, share, start_at))
               for share_prompts, share in zip(split_evenly(prompts, processes), shares)]
    parts = await asyncio.gather(*futures)
    return ([r for results, _, _ in parts for r in results], min(p[1] for p in parts), max(p[2] for p in parts))


def _process_share(settings: dict, prompts: list[list[dict]], concurrency: int, start_at: float
                   ) -> tuple[list[RequestResult], float, float]:
    """In a client process: wait for ``start_at``, then :func:`_drive` its share."""
    global _WORKER_LOOP
    args = argparse.Namespace(**settings)
    if _WORKER_LOOP is None:
        _WORKER_LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_WORKER_LOOP)
        atexit.register(_close_worker_clients)
    client = _WORKER_CLIENTS.get(args.base_url)
    if client is None:
        client = _WORKER_CLIENTS[args.base_url] = openai.AsyncOpenAI(
            base_url=args.base_url, api_key=args.api_key or "none", max_retries=0, timeout=args.timeout)

    async def share() -> tuple[list[RequestResult], float, float]:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return await _drive(client, args, prompts, concurrency)

    return _WORKER_LOOP.run_until_complete(share())


def _close_worker_clients() -> None:
    """At a client process's exit: its clients closed on its loop (no pending stream tasks left)."""
    _WORKER_LOOP.run_until_complete(asyncio.gather(*(c.close() for c in _WORKER_CLIENTS.values())))
    _WORKER_LOOP.close()


ROUND_NODES_METRIC = "flashtree_spec_batch_rounds_total"


async def rounds_by_nodes(base_url: str) -> dict[int, float] | None:
    """The server's batched rounds per drafted node count so far (flashtree's ``/metrics``);
    None when the server does not expose them."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            text = (await client.get(url)).text
    except httpx.HTTPError:
        return None
    counts = {}
    for line in text.splitlines():
        if line.startswith(ROUND_NODES_METRIC + "{"):  # flashtree_spec_batch_rounds_total{nodes="64"} 12.0
            counts[int(line.split('"')[1])] = float(line.rpartition(" ")[2])
    return dict(sorted(counts.items())) or None


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(concurrency: int, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration, "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens_per_s": output_tokens / duration, "requests_per_s": len(ok) / duration,
        "mean_acceptance_length": (sum(r.mean_acceptance_length * r.rounds for r in ok) / rounds) if rounds else None,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itls]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with every
    run's throughput and rounds by node count attached."""
    ordered = sorted(runs, key=lambda level: level["output_tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["output_tokens_per_s_runs"] = [level["output_tokens_per_s"] for level in runs]
    chosen["rounds_by_nodes_runs"] = [level["rounds_by_nodes"] for level in runs]
    return chosen


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


TABLE_HEAD = ("| concurrency | requests | errors | output tok/s | req/s | TTFT p50 / p90 / p99 ms | "
              "ITL p50 / p90 / p99 ms | TPOT mean ms | E2E p50 / p99 s | tau | load avg | rounds by nodes |\n"
              + "|" + " --- |" * 12)


def markdown(report: dict) -> str:
    setup = (f"max({report['requests_per_level']}, concurrency) streamed chat requests per level "
             f"(median of {report.get('repeats', 1)} passes), "
             f"max_tokens={report['max_tokens']}, temperature={report['temperature']}, "
             f"ignore_eos={report['ignore_eos']}; client on {report['client']}.")
    lines = [f"# Load test: {report['model']} at {report['base_url']}", "", f"`{report['command']}`", "", setup, "",
             TABLE_HEAD, *(table_row(level) for level in report["levels"])]
    return "\n".join(lines) + "\n"


def table_row(level: dict) -> str:
    ttft, itl, tpot, e2e = level["ttft_s"], level["itl_s"], level["tpot_s"], level["e2e_s"]
    tau = "-" if level["mean_acceptance_length"] is None else f"{level['mean_acceptance_length']:.2f}"
    e2e_text = "-" if e2e["p50"] is None else f"{e2e['p50']:.2f} / {e2e['p99']:.2f}"
    return (f"| {level['concurrency']} | {level['requests']} | {level['errors']} | "
            f"{_throughput(level)} | {level['requests_per_s']:.2f} | "
            f"{_ms(ttft['p50'])} / {_ms(ttft['p90'])} / {_ms(ttft['p99'])} | "
            f"{_ms(itl['p50'])} / {_ms(itl['p90'])} / {_ms(itl['p99'])} | {_ms(tpot['mean'])} | {e2e_text} | {tau} | "
            f"{level.get('load_average_1m', float('nan')):.1f} | {_nodes(level.get('rounds_by_nodes'))} |")


def _throughput(level: dict) -> str:
    runs = level.get("output_tokens_per_s_runs", [])
    text = f"{level['output_tokens_per_s']:.1f}"
    return text if len(runs) < 2 else text + " (" + ", ".join(f"{r:.1f}" for r in runs) + ")"


def _nodes(counts: dict[int, float] | None) -> str:
    return "-" if not counts else " ".join(f"{n}:{count:.0f}" for n, count in counts.items())


async def run(args) -> dict:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0,
                                timeout=args.timeout)
    async with client:
        await one_request(client, args, "Hello")  # warm the connection and the server
        if args.warmup:  # every level once, unmeasured: graph captures and policy exploration happen here
            for concurrency in args.concurrency:
                await run_level(client, args, concurrency)
            print("warm-up done (every level once, unmeasured)", flush=True)
        runs: dict[int, list[dict]] = {c: [] for c in args.concurrency}
        for _ in range(args.repeats):  # whole passes over the levels, so slow drift hits every level
            for concurrency in args.concurrency:
                level = await run_level(client, args, concurrency)
                print(f"concurrency {concurrency}: {level['output_tokens_per_s']:.1f} tok/s, "
                      f"TTFT p50 {_ms(level['ttft_s']['p50'])} ms, ITL p50 {_ms(level['itl_s']['p50'])} ms, "
                      f"errors {level['errors']}", flush=True)
                runs[concurrency].append(level)
        levels = [median_run(runs[c]) for c in args.concurrency]
    return {
        "base_url": args.base_url, "model": args.model, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "requests_per_level": args.requests, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "ignore_eos": args.ignore_eos, "warmup": args.warmup, "repeats": args.repeats,
        "client_processes": args.client_processes, "client": f"{platform.platform()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}", "levels": levels,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2", help="the model name the server serves")
    parser.add_argument("--api-key", default=os.environ.get("FLASHTREE_API_KEY"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per concurrency level (at least the concurrency itself)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (flashtree extension)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--warmup", action="store_true",
                        help="run every level once unmeasured first (a long-running server has captured its "
                             "CUDA graphs and settled its speculation policy; a fresh one has not)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measured passes over the levels; each level reports its median-throughput pass")
    add_prompts_arg(parser)
    add_client_processes_arg(parser)
    parser.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    args.conversations = conversations(args.prompts) if args.prompts else None
    return args


def add_prompts_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", help="the conversations to send, in turn: humaneval, sharegpt-heldout or a .jsonl "
                                          "of {\"prompt\"} / {\"messages\"} lines (default: a few built-in questions)")


def conversations(dataset: str) -> list[list[dict]]:
    """The message lists of ``dataset`` (flashtree.bench.datasets.load_prompts); SystemExit naming the file when a
    line holds token ids, which a chat request cannot carry."""
    from flashtree.bench.datasets import load_prompts
    from flashtree.errors import ConfigError

    try:
        prompts = load_prompts(dataset, 10**6)
    except ConfigError as err:
        raise SystemExit(f"--prompts: {err}") from None
    if any(p.messages is None for p in prompts):
        raise SystemExit(f"--prompts {dataset}: every line needs 'prompt' or 'messages' (token ids cannot be sent "
                         f"through the chat API)")
    return [p.messages for p in prompts]


def add_client_processes_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--client-processes", type=int, default=1,
                        help="share each level's streams out over this many client processes (one process "
                             "parsing thousands of SSE events a second can be the bottleneck)")


def write_report(out_prefix: str, report: dict, table: str) -> None:
    """``OUT.json`` (the report) and ``OUT.md`` (its markdown ``table``), and the table printed."""
    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
