"""What streaming costs the server's Python threads, per streamed token (CPU, no GPU needed).

A served run at many rows on the H200 reached 72% of the engine's own throughput at 32 rows
(benchmarks/journal/session-17-2026-12-03.md): the event loop's work per token (an SSE event
through FastAPI, Starlette and uvicorn) and the engine thread's share one interpreter lock. This
script measures that work directly: it starts ``flashtree serve`` on a tiny random model (with
SmolLM2's tokenizer, so detokenizing is real), streams chat requests at one concurrency level,
and reads each server thread's CPU time from ``/proc/PID/task`` before and after. It reports CPU
microseconds per streamed token of the main thread (event loop: HTTP, SSE), of the engine
thread, and of the rest, for each variant of the serve command, in alternation over repeats.

    PYTHONPATH=. python benchmarks/cpu_stream_overhead.py --variant default= \\
        --variant h11="--http h11 --loop asyncio" --concurrency 32 --requests 96 --repeats 3 \\
        [--variant before= --code before=/tmp/worktree-of-another-commit] --out FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import run_level  # noqa: E402
from qwen3_8b_shape import write_served_pair  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tiny_model(root: Path) -> Path:
    """A tiny random Qwen3-shaped target with SmolLM2's tokenizer and chat template."""
    from flashtree.models.loader import resolve_model_dir

    model, _ = write_served_pair(root / "model", root / "draft", TINY)
    converted = resolve_model_dir("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(converted / name, model / name)
    return model


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each of the server's threads, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that just ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return out


def by_role(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds of a pass by thread role: the main thread (the event loop), the engine thread
    (with --threads 1 torch computes on it: the busiest other thread; Python 3.11 does not give
    threads OS names to tell it by) and the rest (request handlers' thread pool)."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = spent.pop(pid, 0.0)
    engine = max(spent.values(), default=0.0)
    return {"main": main, "engine": engine, "other": sum(spent.values()) - engine}


def start_server(model: Path, port: int, flags: str, log: Path, code: Path | None = None) -> subprocess.Popen:
    """``flashtree serve`` of this checkout, or of ``code`` (another checkout, e.g. a git worktree)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code.resolve())
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", str(model), "--random-weights",
               "--spec", "none", "--max-running", "32", "--max-context", "1024", "--port", str(port),
               "--log-level", "warning", "--threads", "1", *shlex.split(flags)]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            cwd=code.resolve() if code is not None else None)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server on port {port} exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server on port {port} was not healthy after {timeout:.0f} s")


async def one_pass(url: str, model: Path, args) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    level_args = argparse.Namespace(base_url=url, model=str(model), requests=args.requests, max_tokens=args.max_tokens,
                                    temperature=0.0, ignore_eos=True, client_processes=1)
    async with client:
        return await run_level(client, level_args, args.concurrency)


def measure(pid: int, url: str, model: Path, args) -> dict:
    before = thread_cpu_seconds(pid)
    level = asyncio.run(one_pass(url, model, args))
    spent = by_role(pid, before, thread_cpu_seconds(pid))
    tokens = level["output_tokens"]
    return {"tokens": tokens, "tokens_per_s": level["output_tokens_per_s"], "errors": level["errors"],
            **{f"{k}_us_per_token": 1e6 * v / max(tokens, 1) for k, v in spent.items()}}


def summary(rows: list[dict], variants: list[str]) -> str:
    lines = ["| variant | main thread us / token | engine thread us / token | other threads us / token | "
             "tokens/s (median) | passes |", "| --- | --- | --- | --- | --- | --- |"]
    for name in variants:
        mine = [r for r in rows if r["variant"] == name]
        med = {k: statistics.median(r[k] for r in mine) for k in
               ("main_us_per_token", "engine_us_per_token", "other_us_per_token", "tokens_per_s")}
        spread = [round(r["main_us_per_token"], 1) for r in mine]
        lines.append(f"| {name} | {med['main_us_per_token']:.1f} ({spread}) | {med['engine_us_per_token']:.1f} | "
                     f"{med['other_us_per_token']:.1f} | {med['tokens_per_s']:.1f} | {len(mine)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                        help="a serve command variant: its name and extra `flashtree serve` flags (repeat)")
    parser.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                        help="run variant NAME's server from the checkout DIR (e.g. a git worktree of another commit)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8160)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flashtree-stream-overhead"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = dict(entry.partition("=")[::2] for entry in args.variant)
    code = {name: Path(path) for name, path in (entry.partition("=")[::2] for entry in args.code)}
    if set(code) - set(variants):
        raise SystemExit(f"--code names variants that are not given: {sorted(set(code) - set(variants))}")
    model = tiny_model(args.workdir)
    servers = {}
    try:
        for i, (name, flags) in enumerate(variants.items()):
            log = args.workdir / f"serve_{i}.log"
            servers[name] = (start_server(model, args.port + i, flags, log, code.get(name)), args.port + i)
        for name, (server, port) in servers.items():
            wait_healthy(port, server)
            asyncio.run(one_pass(f"http://127.0.0.1:{port}/v1", model, args))  # warm-up, unmeasured
        rows = []
        names = list(variants)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                server, port = servers[name]
                row = {"variant": name, "repeat": repeat, **measure(server.pid, f"http://127.0.0.1:{port}/v1", model, args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(timeout=30)
    table = summary(rows, names)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "variants": variants,
            "code": {k: str(v) for k, v in code.items()}, "machine": (
            f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"),
            "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
            "passes": rows}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
