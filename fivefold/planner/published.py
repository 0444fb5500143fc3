"""The step-time model against published training runs (fivefold/planner/published_runs.toml: each run's
source, hardware, model, layout, batch and reported throughput).

Each run is predicted on its shipped hardware profile with the layout the source states, fused
elementwise kernels unless the run says `compiled = false`, and the attention kernel of its day
(`attention = "eager"` for runs from before FlashAttention). What the source leaves
out (micro-batch size, virtual pipeline stages, the ZeRO stage, the schedule) the layout search fills in
with its best choice that fits the device memory, else its best choice regardless of memory (the run did
fit on the real system). No constant is set per run.

The error is (predicted - published) / published in MFU, which for a given model, hardware and batch is
the same ratio as in tokens/s per GPU. MFU here is fivefold's (formulas.flops_per_token: 6 N + 12 L s
q_size per token, no recomputation), applied to both figures.
"""

from __future__ import annotations

import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import Config
from fivefold.memory import formulas
from fivefold.parallel.rules import check_layout
from fivefold.planner.hardware import load_profile
from fivefold.planner.search import search_layouts
from fivefold.presets import get_preset

RUNS = Path(__file__).parent / "published_runs.toml"
_TRAIN_KEYS = ("micro_batch_size", "recompute")


@dataclass
class RunCheck:
    name: str
    source: str
    verified: bool
    hardware: str
    gpus: int
    model: str
    published: float  # tokens/s per GPU
    predicted: float
    published_mfu: float
    predicted_mfu: float
    layout: str  # the predicted layout, as --set overrides
    filled: list[str]  # layout keys the search chose
    memory_fits: bool

    @property
    def error(self) -> float:
        return self.predicted_mfu / self.published_mfu - 1


def load_runs(path: Path = RUNS) -> list[dict]:
    with open(path, "rb") as f:
        return tomllib.load(f)["run"]


def run_config(run: dict) -> Config:
    """The run's model, sequence length and precision as a fivefold config (the search applies the layout)."""
    cfg = Config()
    if "preset" in run:
        cfg.model = get_preset(run["preset"])
    for key, value in run.get("model", {}).items():
        setattr(cfg.model, key, value)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, run["seq_len"])
    cfg.train.seq_len, cfg.train.precision = run["seq_len"], run.get("precision", "bf16-mixed")
    # An eager run's memory is eager's too: its blocks and loss keep what eager PyTorch keeps.
    cfg.train.compile = "auto" if run.get("compiled", True) else "false"
    check_layout(cfg, implemented=False)  # a layout another framework runs
    return cfg


def check_run(run: dict) -> RunCheck:
    cfg = run_config(run)
    profile = load_profile(run["hardware"])
    only = dict(run["layout"])
    tokens = run["global_batch"] * run["seq_len"]
    fused = run.get("compiled", True)
    # Another framework's run: its layout need not be one fivefold implements (e.g. ZeRO-2 under pp).
    result = search_layouts(cfg, profile, run["gpus"], tokens, top=1, fused=fused, only=only, implemented_only=False)
    fits = bool(result.ranked)
    if not fits:
        result = search_layouts(cfg, profile, run["gpus"], tokens, top=1, fused=fused, only=only,
                                device_memory=math.inf, implemented_only=False)
    if not result.ranked:
        raise ValueError(f"published run {run['name']}: no legal layout matches {only}")
    best = result.ranked[0]
    per_token = formulas.flops_per_token(cfg.model, cfg.train.seq_len)
    peak = best.speed.peak_flops
    relevant = {"pp_schedule": only.get("pp", 1) > 1, "pp_virtual_stages": only.get("pp", 1) > 1,
                "sequence_parallel": only.get("tp", 1) > 1, "zero": only.get("dp", 1) * only.get("cp", 1) > 1}
    filled = [k for k in ("micro_batch_size", "pp_schedule", "pp_virtual_stages", "zero", "recompute",
                          "sequence_parallel") if k not in only and relevant.get(k, True)]
    return RunCheck(name=run["name"], source=run["source"], verified=run["verified"], hardware=run["hardware"],
                    gpus=run["gpus"], model=run.get("preset") or _describe(cfg),
                    published=run["tokens_per_s_per_gpu"], predicted=best.speed.tokens_per_s_per_gpu,
                    published_mfu=run["tokens_per_s_per_gpu"] * per_token / peak, predicted_mfu=best.speed.mfu,
                    layout=best.overrides(), filled=filled, memory_fits=fits)


def _describe(cfg: Config) -> str:
    billions = formulas.count_params(cfg.model) / 1e9
    return f"{billions:.3g}B (h={cfg.model.hidden_size}, L={cfg.model.num_layers})"


def summary(checks: list[RunCheck]) -> dict:
    """Median and worst absolute MFU error over the verified runs (recalled figures are reported, not counted)."""
    counted = [abs(c.error) for c in checks if c.verified]
    return {"runs": len(counted), "sources": len({c.source.split(",")[0].split("(")[0].strip() for c in checks
                                                    if c.verified}),
            "median_abs_error": statistics.median(counted), "worst_abs_error": max(counted)}


def markdown(checks: list[RunCheck]) -> str:
    s = summary(checks)
    lines = [f"Verified runs: {s['runs']} from {s['sources']} sources; |MFU error| median "
             f"{100 * s['median_abs_error']:.1f}%, worst {100 * s['worst_abs_error']:.1f}%.", "",
             "| run | hardware | GPUs | model | published tok/s/GPU | predicted | published MFU | predicted MFU "
             "| error | chosen by the search | source |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        chosen = ", ".join(f"{k}" for k in c.filled) or "-"
        if not c.memory_fits:
            chosen += " (memory model: does not fit)"
        mark = "" if c.verified else " (recalled, not counted)"
        lines.append(f"| {c.name}{mark} | {c.hardware} | {c.gpus} | {c.model} | {c.published:,.0f} | {c.predicted:,.0f} "
                     f"| {100 * c.published_mfu:.1f}% | {100 * c.predicted_mfu:.1f}% | {100 * c.error:+.1f}% "
                     f"| {chosen} | {c.source} |")
    return "\n".join(lines)
