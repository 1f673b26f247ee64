"""Schemathesis over a running server's OpenAPI schema: generated requests to every route, counting 5xx.

Starts ``flashtree serve`` on ``--model`` (CPU), waits for /health, runs ``schemathesis run`` with the
``not_a_server_error`` check and ``--max-examples`` per operation, and writes the summary (the
operations, the examples sent and the failures schemathesis reports) to ``--out``. Issue #31's target:
2,000 examples, zero 5xx. ``--pin-model``: every body's ``model`` is the served one (the schema is
fetched and pinned first), so generated requests get past the model check to the engine.

    python benchmarks/api_fuzz.py --model /tmp/tiny-chat --max-examples 160 --out benchmarks/results/api_fuzz_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stream_overhead import wait_healthy  # noqa: E402


def serve(model: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "flashtree.cli", "serve", "--model", model, "--device", "cpu", "--port", str(port),
               "--max-context", "128", "--max-running", "8", "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, server, timeout=300)
    return server


def pinned_schema(url: str, model: str, path: Path) -> str:
    """The served OpenAPI schema with every ``model`` property fixed to ``model``, written to ``path``."""
    schema = httpx.get(f"{url}/openapi.json", timeout=30).json()
    for component in schema.get("components", {}).get("schemas", {}).values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"] = {"type": "string", "enum": [model]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schema))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--max-examples", type=int, default=160)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pin-model", action="store_true", help="bodies name the served model")
    args = parser.parse_args()
    server = serve(args.model, args.port)
    url = f"http://127.0.0.1:{args.port}"
    try:
        schema = f"{url}/openapi.json"
        if args.pin_model:
            schema = pinned_schema(url, args.model, Path(args.out).with_suffix(".schema.json"))
        started = time.perf_counter()
        run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", schema,
                              "--url", url, "--checks", "not_a_server_error",
                              "--max-examples", str(args.max_examples), "--request-timeout", "60", "--no-color"],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(30)
    text = run.stdout + run.stderr
    summary = {"model": args.model, "pinned_model": args.pin_model, "max_examples_per_operation": args.max_examples,
               "exit_code": run.returncode,
               "seconds": round(seconds, 1),
               "test_cases": [int(n) for n in re.findall(r"(\d+) generated", text)][-1:] or None,
               "server_errors": len(re.findall(r"Server error", text)), "tail": text[-3000:]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(text[-2500:])


if __name__ == "__main__":
    main()
