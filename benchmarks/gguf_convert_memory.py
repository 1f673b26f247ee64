"""Peak memory and time of a GGUF conversion (``models/gguf_convert.py``), each run in a fresh process.

    python benchmarks/gguf_convert_memory.py --gguf /tmp/qwen3-1.7b-shape.q4_0.gguf \
        --out benchmarks/results/gguf_convert_memory_epyc_2026-12-05.json

Each run converts into a private temporary cache, so nothing is reused; the figure is the child's peak
resident set (its own ``ru_maxrss``), which counts the GGUF file's pages it touched. ``--code DIR`` runs another
checkout's flashtree (an earlier commit, for a before / after pair).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import resource, sys, time
import flashtree
from pathlib import Path
from flashtree.models.gguf_convert import convert_gguf
start = time.perf_counter()
out = convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
print(time.perf_counter() - start, sum(f.stat().st_size for f in out.iterdir()),
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flashtree.__file__)
"""


def convert_once(gguf: str, code: str | None) -> dict:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code
    with tempfile.TemporaryDirectory(prefix="convert-") as cache:
        result = subprocess.run([sys.executable, "-c", CHILD, gguf, cache], env=env, capture_output=True, text=True,
                                cwd=cache)  # (not this checkout: ``-c`` puts the working directory first on sys.path)
        if result.returncode:
            raise SystemExit(result.stderr)
        seconds, size, peak_kib, package = result.stdout.split()
    return {"package": package, "seconds": round(float(seconds), 1), "peak_rss_mib": round(int(peak_kib) / 1024),
            "cache_bytes": int(size)}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--code", action="append", default=[], metavar="DIR",
                        help="a flashtree checkout to run instead of the installed one (repeatable; each is a row)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for code in [None, *args.code]:
        row = {"code": code or "installed", **convert_once(args.gguf, code)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {"gguf": args.gguf, "gguf_bytes": Path(args.gguf).stat().st_size, "cpu": cpu_name(),
              "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
