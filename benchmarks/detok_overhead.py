"""Host time spent turning output tokens into text, per engine step and request: decoding the
whole output every step (what the engine did until the third session) vs the incremental
window (engine/output.py TextTracker.text). SmolLM2's tokenizer; one token per step.

    python benchmarks/detok_overhead.py --out benchmarks/results/detok_overhead.json
"""

import argparse
import json
import platform
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
    args = parser.parse_args()
    tracker = TextTracker(load_checkpoint("smollm2", random_weights=True).tokenizer)
    text = " ".join(f"Step {i}: the quick brown fox jumps over the lazy dog, 漢字 😀." for i in range(400))
    all_ids = tracker.tokenizer.encode(text)
    rows = []
    for length in (128, 512, 2048):
        ids = all_ids[:length]
        full, incr = per_step_us(tracker, ids, False), per_step_us(tracker, ids, True)
        rows.append({"output_tokens": length, "full_decode_us_per_step": full, "incremental_us_per_step": incr})
        print(f"{length:>5} tokens: full decode {full:8.1f} us/step, incremental {incr:6.1f} us/step", flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
