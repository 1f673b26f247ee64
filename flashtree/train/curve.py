"""The training curve as a PNG beside the checkpoint: loss and the tau estimate against steps,
for the training windows (one point per ``log_every`` steps) and the held-out evals."""

from __future__ import annotations

from pathlib import Path

CURVE_FILE = "train_curve.png"


def write_curve(out_dir: str | Path, history: list[dict], title: str = "") -> Path | None:
    """Plot ``history`` (entries with "step", "split" train|heldout, "loss", "tau") to
    ``out_dir/train_curve.png``; None when there is nothing to plot yet."""
    points = [h for h in history if "loss" in h and "step" in h]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, tau_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for split, style in (("train", "-"), ("heldout", "o-")):
        part = [h for h in points if h.get("split", "heldout") == split]
        if not part:
            continue
        steps = [h["step"] for h in part]
        loss_ax.plot(steps, [h["loss"] for h in part], style, label=split, markersize=3)
        tau_ax.plot(steps, [h["tau"] for h in part], style, label=split, markersize=3)
    loss_ax.set(xlabel="step", ylabel="loss (decayed cross-entropy)")
    tau_ax.set(xlabel="step", ylabel="tau estimate (DFlash, from slot accuracy)")
    for ax in (loss_ax, tau_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out_dir) / CURVE_FILE
    tmp = path.with_name("tmp-" + path.name)  # keeps the .png suffix: matplotlib picks the format by it
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
