"""Host time spent turning output tokens into text, per engine step and request: decoding the
whole output every step (what the engine did until the third session) vs the incremental
windows in Python (engine/output.py TextTracker.text, ``rust_stream=False``) vs the tokenizers
library's DecodeStream (the default since 2026-12-07). SmolLM2's tokenizer; one token per step;
``--repeats`` alternating runs, medians.

    python benchmarks/detok_overhead.py --out benchmarks/results/detok_overhead.json
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from flashtree.engine.output import TextTracker
from flashtree.engine.request import Request
from flashtree.models.loader import load_checkpoint
from flashtree.sampling import SamplingParams


def per_step_us(tracker: TextTracker, ids: list[int], incremental: bool) -> float:
    req = Request(prompt_ids=[1], params=SamplingParams())
    t0 = time.perf_counter()
    for token in ids:
        req.output_ids.append(token)
        if incremental:
            tracker.text(req)
        else:
            tracker.stable(tracker.decode(req.output_ids))
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/detok_overhead.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_checkpoint("smollm2", random_weights=True).tokenizer
    tracker, windows = TextTracker(tokenizer), TextTracker(tokenizer, rust_stream=False)
    text = " ".join(f"Step {i}: the quick brown fox jumps over the lazy dog, 漢字 😀." for i in range(400))
    all_ids = tracker.tokenizer.encode(text)
    rows = []
    for length in (128, 512, 2048):
        ids = all_ids[:length]
        runs = [(per_step_us(tracker, ids, False), per_step_us(windows, ids, True), per_step_us(tracker, ids, True))
                for _ in range(args.repeats)]
        full, python_windows, stream = (statistics.median(r[i] for r in runs) for i in range(3))
        rows.append({"output_tokens": length, "full_decode_us_per_step": full,
                     "python_windows_us_per_step": python_windows, "decode_stream_us_per_step": stream})
        print(f"{length:>5} tokens: full decode {full:8.1f} us/step, Python windows {python_windows:6.2f}, "
              f"DecodeStream {stream:6.2f} us/step", flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
