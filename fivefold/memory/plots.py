"""Figures: the stacked-area memory timeline of the first training steps, and activation sweeps."""

from __future__ import annotations

from pathlib import Path

from fivefold.memory.units import CATEGORIES

COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868",
          "activations": "#C44E52", "temporary": "#8172B3"}


def pyplot():
    """matplotlib, headless; imported on first use (an optional dependency, and slow to import)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_timeline(timeline, path: str | Path, title: str | None = None) -> Path:
    """Stacked areas per category over the ops of the measured steps, step boundaries marked, and the
    planner's predicted total as a dashed line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.8))
    x = range(len(timeline.samples))
    scale, unit = _unit(timeline.peaks["total"])
    ys = [[v / scale for v in timeline.series(c)] for c in CATEGORIES]
    ax.stackplot(x, *ys, labels=[c.replace("_", " ") for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES],
                 alpha=0.9, linewidth=0)
    for index, label in timeline.marks:
        if label.startswith("step"):
            ax.axvline(index, color="black", linewidth=0.8)
            ax.text(index, 1.0, f" {label}", transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)
        elif label in ("optimizer step", "zero_grad"):
            ax.axvline(index, color="grey", linewidth=0.5, linestyle=":")
    if timeline.predicted:
        ax.axhline(timeline.predicted["total"] / scale, color="black", linestyle="--", linewidth=1,
                   label="predicted peak (fivefold plan)")
    ax.set_xlabel("operator (time)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_xlim(0, max(1, len(timeline.samples) - 1))
    ax.set_title(title or f"Memory of the first {timeline.steps} training steps ({timeline.device})", pad=16)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _save(plt, fig, path)


def plot_sweep(result: dict, key: str, path: str | Path, title: str) -> Path:
    """Activation bytes against sequence length or micro-batch size, log-log, eager vs SDPA."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = result["values"]
    scale, unit = _unit(max(max(result["eager"]), max(result["sdpa"])))
    ax.plot(xs, [v / scale for v in result["eager"]], "o-", label="eager attention (s^2 scores saved)")
    ax.plot(xs, [v / scale for v in result["sdpa"]], "s-", label="SDPA / flash (no s^2 term)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel({"seq": "sequence length (tokens)", "batch": "micro-batch size (sequences)"}[key])
    ax.set_ylabel(f"activation memory per rank ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_recompute_sweep(rows: list[dict], num_layers: int, path: str | Path, title: str) -> Path:
    """Activation bytes against the extra compute of recomputation: a line from none to full through
    every k-th layer, Chen et al.'s k = sqrt(n) marked, selective apart."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    scale, unit = _unit(max(r["activations"] for r in rows))
    line = [r for r in rows if r["recompute"] != "selective"]
    ax.plot([100 * r["extra_compute"] for r in line], [r["activations"] / scale for r in line], "o-",
            label="full recompute of every k-th layer")
    for r in rows:
        ax.annotate(r["recompute"], (100 * r["extra_compute"], r["activations"] / scale), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    root = min(line, key=lambda r: abs(r["recomputed_layers"] - num_layers ** 0.5))
    ax.plot([100 * root["extra_compute"]], [root["activations"] / scale], "*", markersize=14,
            label=f"k = sqrt(n): {root['recomputed_layers']} of {num_layers} layers")
    selective = [r for r in rows if r["recompute"] == "selective"]
    if selective:
        ax.plot([100 * selective[0]["extra_compute"]], [selective[0]["activations"] / scale], "s",
                label="selective (attention core only)")
    ax.set_xlabel("extra compute (recomputed forward FLOPs, % of the step)")
    ax.set_ylabel(f"activation memory per rank ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _unit(peak: float) -> tuple[float, str]:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if peak >= scale:
            return scale, unit
    return 1.0, "B"
