"""`fivefold plot RUN_DIR`: a run's metrics.jsonl drawn over tokens seen: the loss (train, and validation
where evaluated), the learning rate, and the global batch beside the gradient noise scale, so a run with
train.batch_ramp=auto shows its batch following B_simple (McCandlish et al. 2018)."""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.config import ConfigError


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (a line cut short by a run still writing is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl; give the run directory `fivefold train --out` "
                                f"wrote (it logs every train.log_every steps)")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise ConfigError(f"{path} holds no step records yet; plot it once the run has logged a step")
    return records


def plot_run(run_dir: str | Path, png: str | Path | None = None) -> Path:
    """Draw RUN_DIR's metrics into `png` (default RUN_DIR/metrics.png); returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    # Older records may lack tokens_seen; the step is the next best x.
    by_tokens = all("tokens_seen" in r for r in records)
    x_key, x_label = ("tokens_seen", "tokens seen") if by_tokens else ("step", "step")

    def series(key: str) -> tuple[list, list]:
        rows = [(r[x_key], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        return [x for x, _ in rows], [y for _, y in rows]

    fig, (loss_ax, lr_ax, batch_ax) = plt.subplots(3, 1, sharex=True, figsize=(8, 9))
    loss_ax.plot(*series("loss"), label="train loss")
    if any("val_loss" in r for r in records):
        loss_ax.plot(*series("val_loss"), "o-", label="validation loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    lr_ax.plot(*series("lr"))
    lr_ax.set_ylabel("learning rate")
    batch_ax.step(*series("batch_tokens"), where="post", label="global batch")
    gns_x, gns_y = series("gns")
    if gns_y:
        batch_ax.plot(gns_x, gns_y, ".", alpha=0.6, label="gradient noise scale B_simple")
    batch_ax.set_yscale("log")
    batch_ax.set_ylabel("tokens")
    batch_ax.set_xlabel(x_label)
    batch_ax.legend()
    loss_ax.set_title(f"{Path(run_dir).resolve().name}: {len(records)} logged steps")
    fig.tight_layout()
    out = Path(png) if png else Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
