"""A soak test of `flashtree serve` on the CPU: many streaming clients for minutes, with clients that
leave mid-stream and one huge request thrown in; nothing may be lost, corrupted or stalled.

Starts ``flashtree serve`` (``--serve-flags``), then for ``--minutes``: ``--clients`` streaming chat
clients, each sending greedy requests back to back (``--max-tokens`` each, prompts in turn);
``--disconnects`` per minute more requests that are dropped after 0.1-1.5 s; one request with a
``--big-mb`` MB body a third of the way in. Checks and reports:
- lost: requests that ended without a finish reason, or with an error other than the big one's;
- corrupted: a greedy answer that differs from the first answer to the same prompt;
- stalls: each stream's largest gap between chunks that carry text, from its first text on (the
  wait for the first, behind other arrivals' prefills, is its time to first token, reported apart);
- memory: the server's resident set every 5 s (start of the second minute, end, largest).
Writes ``--out`` (JSON). CPU, 2 cores:

    python benchmarks/soak_test.py --minutes 10 --clients 64 --out benchmarks/results/soak_cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
from cpu_stream_overhead import wait_healthy  # noqa: E402
from load_test import PROMPTS  # noqa: E402


class Tally:
    def __init__(self):
        self.done = self.lost = self.corrupted = self.dropped = 0
        self.errors: list[str] = []
        self.gaps: list[float] = []  # per finished stream: its largest gap between chunks with text
        self.ttfts: list[float] = []  # per finished stream: sending -> its first text
        self.first_answer: dict[str, str] = {}
        self.big: str | None = None


async def one_stream(client: openai.AsyncOpenAI, args, prompt: str, tally: Tally) -> None:
    largest, last, text, finish = 0.0, None, "", None
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
            temperature=0, stream=True)
        async for chunk in stream:
            now = time.perf_counter()
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            piece = chunk.choices[0].delta.content or ""
            if piece:
                if last is None:
                    tally.ttfts.append(now - sent)
                else:
                    largest = max(largest, now - last)
                last = now
                text += piece
    except openai.APIError as err:
        tally.lost += 1
        tally.errors.append(f"{type(err).__name__}: {err}"[:300])
        return
    if finish is None:
        tally.lost += 1
        tally.errors.append(f"no finish reason after {len(text)} characters")
        return
    tally.done += 1
    tally.gaps.append(largest)
    if tally.first_answer.setdefault(prompt, text) != text:
        tally.corrupted += 1
        tally.errors.append(f"answer to {prompt!r} differs: {text[:80]!r} vs {tally.first_answer[prompt][:80]!r}")


async def client_loop(client, args, index: int, stop_at: float, tally: Tally) -> None:
    turn = index
    while time.monotonic() < stop_at:
        await one_stream(client, args, PROMPTS[turn % len(PROMPTS)], tally)
        turn += 1


async def disconnects(url: str, args, stop_at: float, tally: Tally) -> None:
    """Streams dropped early: the server must free their slots and go on."""
    period = 60.0 / args.disconnects
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < stop_at:
            await asyncio.sleep(period)
            body = {"model": args.model, "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                    "max_tokens": args.max_tokens, "stream": True}
            try:
                async with asyncio.timeout(random.uniform(0.1, 1.5)):
                    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            pass
            except (TimeoutError, httpx.HTTPError):
                pass
            tally.dropped += 1


async def big_request(url: str, args, at: float, tally: Tally) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    body = json.dumps({"model": args.model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "cat " * (args.big_mb * 262_144)}]})
    async with httpx.AsyncClient(timeout=300) as http:
        start = time.perf_counter()
        response = await http.post(f"{url}/v1/chat/completions", content=body,
                                   headers={"Content-Type": "application/json"})
        tally.big = f"HTTP {response.status_code} after {time.perf_counter() - start:.2f} s"


async def memory(pid: int, stop_at: float, samples: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while time.monotonic() < stop_at:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                samples.append((round(time.monotonic() - start, 1), int(line.split()[1]) // 1024))
        await asyncio.sleep(5)


async def soak(url: str, pid: int, args) -> dict:
    tally, samples = Tally(), []
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    async with client:
        tasks = [client_loop(client, args, i, stop_at, tally) for i in range(args.clients)]
        tasks += [disconnects(url, args, stop_at, tally), memory(pid, stop_at, samples)]
        if args.big_mb:
            tasks.append(big_request(url, args, start + args.minutes * 20, tally))
        await asyncio.gather(*tasks)
    after_first_minute = next((mb for t, mb in samples if t >= 60), samples[0][1] if samples else None)
    gaps, ttfts = sorted(tally.gaps), sorted(tally.ttfts)
    return {"finished": tally.done, "lost": tally.lost, "corrupted": tally.corrupted, "dropped_on_purpose": tally.dropped,
            "big_request": tally.big, "largest_gap_s": round(gaps[-1], 3) if gaps else None,
            "streams_with_gap_over_1s": sum(g > 1.0 for g in gaps),
            "p50_largest_gap_s": round(gaps[len(gaps) // 2], 3) if gaps else None,
            "ttft_s": {"p50": round(ttfts[len(ttfts) // 2], 3), "p99": round(ttfts[int(len(ttfts) * 0.99)], 3),
                       "max": round(ttfts[-1], 3)} if ttfts else None,
            "rss_mib": {"after_first_minute": after_first_minute, "end": samples[-1][1] if samples else None,
                        "largest": max((mb for _, mb in samples), default=None)},
            "errors": tally.errors[:20], "rss_samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--disconnects", type=float, default=20, help="dropped requests per minute")
    parser.add_argument("--big-mb", type=int, default=10, help="the huge request's size (0: none)")
    parser.add_argument("--port", type=int, default=8177)
    parser.add_argument("--serve-flags", default="--max-running 64", help="more flashtree serve flags")
    args = parser.parse_args()
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", args.model, "--port", str(args.port),
               *shlex.split(args.serve_flags)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(f"{args.out}.server.log", "w"),
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(args.port, server)
        report = asyncio.run(soak(f"http://127.0.0.1:{args.port}", server.pid, args))
    finally:
        server.terminate()
        server.wait(timeout=60)
    from flashtree.bench.environment import cpu_name

    report = {"machine": cpu_name() or platform.machine(), "cores": os.cpu_count(), "command": command,
              "minutes": args.minutes, "clients": args.clients, "max_tokens": args.max_tokens, **report}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))


if __name__ == "__main__":
    main()
