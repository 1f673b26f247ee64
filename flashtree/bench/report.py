"""The benchmark report: a JSON document and a markdown table.

JSON: ``{"config": {...}, "methods": [summary per method], "inexact_methods": [labels]}``
(a summary is :func:`flashtree.bench.metrics.summarize`'s record). ``inexact_methods`` lists flashtree's
methods only: llama.cpp, a comparison from outside, may part from plain decoding by design
(``bench/llamacpp.py``); its row says where instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashtree.bench.llamacpp import LLAMA_CPP

INEXACT_MARK = "NO (differs from ar)"
EXTERNAL_MARK = "differs from ar (8-bit activations)"  # llama.cpp's row when its tokens part from ours


def build_report(config: dict, summaries: list[dict]) -> dict:
    return {"config": config, "methods": summaries,
            "inexact_methods": [s["method"] for s in summaries if not s["exact"] and s["spec"] != LLAMA_CPP]}


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def markdown(report: dict) -> str:
    config = report["config"]
    stages = _stage_names(report["methods"])
    header = ["method", "budget", "tau", "tokens/s", "speedup", "exact"] + [f"{s} s" for s in stages]
    lines = [
        f"# flashtree bench: {config.get('model')} on {config.get('dataset')}",
        "",
        f"{config.get('num_prompts')} prompts, {config.get('max_new_tokens')} new tokens max, "
        f"temperature {config.get('temperature')}, batch {config.get('batch_size')}, "
        f"{config.get('dtype')} on {config.get('device_name')} ({config.get('device')}), torch {config.get('torch')}",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += [_row(s, stages) for s in report["methods"]]
    if report["inexact_methods"]:
        lines += ["", f"**Inexact:** {', '.join(report['inexact_methods'])} produced tokens different from "
                      "plain decoding (see `mismatched_prompts` / `first_divergence` in the JSON)."]
    return "\n".join(lines) + "\n"


def _row(summary: dict, stages: list[str]) -> str:
    cells = [summary["method"], str(summary["budget"]), f"{summary['tau']:.2f}",
             f"{summary['tokens_per_s']:.1f}", f"{summary['speedup']:.2f}x",
             _exactness(summary)]
    cells += [f"{summary['stage_seconds'].get(s, 0.0):.3f}" for s in stages]
    return "| " + " | ".join(cells) + " |"


def _exactness(summary: dict) -> str:
    if summary["exact"]:
        return "yes"
    return EXTERNAL_MARK if summary["spec"] == LLAMA_CPP else f"**{INEXACT_MARK}**"


def _stage_names(summaries: list[dict]) -> list[str]:
    names: list[str] = []
    for summary in summaries:
        names += [name for name in summary["stage_seconds"] if name not in names]
    return names


def write_markdown(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(report))
