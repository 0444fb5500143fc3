"""The parity harness: compare two runs' per-step metrics (e.g. a parallel layout against one process).

Every parallel feature is proven the same way: run config A and config B from the same seed and global
batch, then require their losses to agree step by step within a tight tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


def read_metric(run: str | Path, key: str = "loss") -> dict[int, float]:
    """{step: value} from a run directory's metrics.jsonl (or the file itself, or a golden JSON list)."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}; train with train.log_every=1 to compare every step")
    if path.suffix == ".json":
        records = json.loads(path.read_text(encoding="utf-8"))
    else:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {int(r["step"]): float(r[key]) for r in records if key in r}


@dataclass
class Comparison:
    steps: list[int]
    max_abs: float
    max_rel: float
    first_mismatch: int | None  # the first step outside tolerance, or None
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None and bool(self.steps)

    def summary(self) -> str:
        verdict = "MATCH" if self.ok else (f"MISMATCH from step {self.first_mismatch}" if self.steps
                                           else "no common steps")
        return (f"{verdict}: {len(self.steps)} common steps, max |diff| {self.max_abs:.3e}, "
                f"max relative {self.max_rel:.3e} (rtol {self.rtol:g}, atol {self.atol:g})")


def compare_metrics(a: dict[int, float], b: dict[int, float], rtol: float = 1e-5, atol: float = 0.0) -> Comparison:
    steps = sorted(set(a) & set(b))
    max_abs = max_rel = 0.0
    first = None
    for step in steps:
        x, y = a[step], b[step]
        diff = abs(x - y)
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(abs(y), 1e-30))
        if (diff > atol + rtol * abs(y) or not math.isfinite(x) or not math.isfinite(y)) and first is None:
            first = step
    return Comparison(steps, max_abs, max_rel, first, rtol, atol)


def compare_runs(a: str | Path, b: str | Path, key: str = "loss", rtol: float = 1e-5, atol: float = 0.0) -> Comparison:
    return compare_metrics(read_metric(a, key), read_metric(b, key), rtol, atol)
