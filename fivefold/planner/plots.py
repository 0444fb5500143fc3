"""The layout search's picture: where each of the best layouts' step time goes."""

from __future__ import annotations

from pathlib import Path

from fivefold.memory.plots import pyplot
from fivefold.planner.speed import BREAKDOWN

COLORS = {"compute": "#4c78a8", "recompute": "#9ecae9", "tp": "#f58518", "cp": "#ffbf79", "ep": "#e45756",
          "pp": "#b279a2", "dp": "#54a24b", "bubble": "#bab0ac", "optimizer": "#72b7b2", "slowest": "#d6616b",
          "host": "#eeca3b"}


def plot_breakdown(candidates, path: str | Path, title: str) -> Path:
    """One horizontal bar per layout, best at the top: seconds per token per GPU, split by category."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(candidates) + 1.8))
    labels = []
    for row, c in enumerate(candidates):
        s = c.speed
        per_token = s.world / s.tokens_per_step * 1e6  # microseconds of one GPU per token
        left = 0.0
        for key in BREAKDOWN:
            width = s.breakdown.get(key, 0.0) * per_token
            if width > 0:
                ax.barh(row, width, left=left, color=COLORS[key])
                left += width
        lay = c.layout()
        labels.append(f"#{row + 1} dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} cp{lay['cp']} z{lay['zero']} "
                      f"{lay['recompute'][:3]} mbs{lay['micro_batch_size']}")
    ax.set_yticks(range(len(candidates)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU-microseconds per token (lower is faster)")
    ax.set_title(title, fontsize=10)
    present = [k for k in BREAKDOWN if any(c.speed.breakdown.get(k, 0.0) > 0 for c in candidates)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in present], present, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
