"""How long a huge request stalls the other streams of a running server (issue #31: a 10 MB body must
not delay other streams by more than 50 ms).

Starts ``flashtree serve`` (with ``--accept``, ``--max-request-bytes`` raised so the body is read,
parsed and tokenized instead of refused at the door with 413), keeps ``--streams`` streamed chat completions running, sends one chat request
whose message is ``--body-mb`` MB of text (it is tokenized off the event loop and then refused as
too long for the context), and reports each stream's largest gap between chunks before the big
request, while it is in flight, and after. Writes ``--out`` (JSON).

    python benchmarks/big_body_stall.py --model smollm2 --out benchmarks/results/big_body_stall_smollm2_epyc.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stream_overhead import wait_healthy  # noqa: E402


def serve(model: str, port: int, body_mb: float, accept: bool) -> subprocess.Popen:
    limit = ["--max-request-bytes", str(int((body_mb + 2) * 1024 * 1024))] if accept else []
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", model, "--device", "cpu", "--port", str(port),
               *limit, "--max-running", "8", "--log-level", "warning", "--spec", "none"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, server, timeout=300)
    return server


async def stream(client: httpx.AsyncClient, url: str, stamps: list[float], stop: asyncio.Event) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 100000,
            "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", url, json=body) as response:
            async for _ in response.aiter_lines():
                stamps.append(time.perf_counter())
                if stop.is_set():
                    return


async def measure(port: int, streams: int, body_mb: float, model_name: str) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    stamps: list[list[float]] = [[] for _ in range(streams)]
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, url, s, stop)) for s in stamps]
        await asyncio.sleep(3.0)
        text = "word " * int(body_mb * 1024 * 1024 / 5)
        sent = time.perf_counter()
        big = await client.post(url, json={"model": model_name, "messages": [{"role": "user", "content": text}],
                                           "max_tokens": 4})
        answered = time.perf_counter()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    def largest_gap(times: list[float], start: float, end: float) -> float:
        inside = [t for t in times if start <= t <= end]
        return max((b - a for a, b in zip(inside, inside[1:])), default=float("nan"))

    return {"big_status": big.status_code, "big_answer": big.text[:300], "big_seconds": answered - sent,
            "body_bytes": len(text),
            "gap_before_ms": [largest_gap(s, sent - 2.5, sent) * 1000 for s in stamps],
            "gap_during_ms": [largest_gap(s, sent, answered + 0.5) * 1000 for s in stamps],
            "gap_after_ms": [largest_gap(s, answered + 0.5, answered + 2.0) * 1000 for s in stamps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8733)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--body-mb", type=float, default=10.0)
    parser.add_argument("--accept", action="store_true",
                        help="raise --max-request-bytes so the body is read, parsed and tokenized (by default the "
                             "server's 8 MiB limit refuses it with 413 before reading it)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    server = serve(args.model, args.port, args.body_mb, args.accept)
    try:
        name = httpx.get(f"http://127.0.0.1:{args.port}/v1/models").json()["data"][0]["id"]
        result = asyncio.run(measure(args.port, args.streams, args.body_mb, name))
    finally:
        server.terminate()
        server.wait(30)
    result.update(model=args.model, streams=args.streams, accepted=args.accept,
                  cpu=platform.processor() or platform.machine())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "big_answer"}, indent=1))


if __name__ == "__main__":
    main()
