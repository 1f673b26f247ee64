"""PNG figures of a benchmark report (matplotlib, Agg backend: no display needed).

- speedup and tau against the draft budget (drafted nodes per round);
- the acceptance-length distribution of every speculative method.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(summary: dict) -> str:
    return summary["method"] if summary["exact"] else f"{summary['method']} (inexact)"


def plot_speedup_and_tau(report: dict, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, title in ((axes[0], "speedup", "speedup over plain decoding"), (axes[1], "tau", "tau (acceptance length)")):
        _plot_against_budget(axis, report["methods"], key)
        axis.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="ar")
        axis.set_title(title)
        axis.set_xlabel("draft budget (nodes per round)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    config = report["config"]
    fig.suptitle(f"{Path(str(config.get('model'))).name} on {Path(str(config.get('dataset'))).name}")
    fig.tight_layout()
    _save(fig, path, plt)


def _plot_against_budget(axis, summaries: list[dict], key: str) -> None:
    trees = sorted((s for s in summaries if s["spec"] == "ddtree"), key=lambda s: s["budget"])
    if trees:
        axis.plot([s["budget"] for s in trees], [s[key] for s in trees], marker="o", label="ddtree")
        for s in trees:
            if not s["exact"]:
                axis.annotate("inexact", (s["budget"], s[key]), color="red", fontsize=8)
    for s in summaries:
        if s["spec"] == "dflash":
            axis.plot([s["budget"]], [s[key]], marker="*", markersize=12, linestyle="none", label=_label(s))
    budgets = [s["budget"] for s in summaries if s["budget"] > 0]
    if budgets and max(budgets) / min(budgets) >= 8:
        axis.set_xscale("log", base=2)


def plot_acceptance_histograms(report: dict, path: Path) -> None:
    plt = _pyplot()
    speculative = [s for s in report["methods"] if s["spec"] != "none"] or report["methods"]
    lengths = sorted({int(k) for s in speculative for k in s["acceptance_histogram"]}) or [1]
    width = 0.8 / len(speculative)
    fig, axis = plt.subplots(figsize=(max(6, 0.5 * len(lengths) + 3), 4))
    for i, summary in enumerate(speculative):
        histogram = summary["acceptance_histogram"]
        rounds = sum(histogram.values()) or 1
        fractions = [histogram.get(str(n), 0) / rounds for n in lengths]
        axis.bar([n - 0.4 + width * (i + 0.5) for n in lengths], fractions, width=width,
                 label=f"{_label(summary)} (tau {summary['tau']:.2f})")
    axis.set_xticks(lengths)
    axis.set_xlabel("acceptance length (tokens per round, bonus included)")
    axis.set_ylabel("fraction of rounds")
    axis.set_title("acceptance-length distribution")
    axis.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, plt)


def _save(fig, path: Path, plt) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
