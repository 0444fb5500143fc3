"""Helpers for the multi-process parity tests: launching layouts under torchrun, comparing weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fivefold.train.checkpoint import load_model

WORKER = Path(__file__).parent / "run_layouts.py"
# Tiny fp32 runs of 10 steps, saving at step 5 (to resume under another layout) and at the end.
BASE = {"train.seq_len": 32, "train.steps": 10, "train.lr": 1e-2, "train.warmup_steps": 2,
        "train.peak_flops": 1e11, "train.progress": False, "train.tensorboard": False, "train.eval_every": 0,
        "train.log_every": 1, "train.save_every": 5, "train.keep_checkpoints": 3}


def copy_checkpoint(src_run: Path, dst_run: Path, step: int) -> None:
    """dst_run starts from src_run's checkpoint at `step`, as if it had written it."""
    import shutil

    name = f"step_{step:08d}"
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)
    (dst_run / "checkpoints" / "latest").write_text(name + "\n")


def torchrun(nproc: int, script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`script` under torchrun with `nproc` single-threaded workers; output captured."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(script), *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def launch_layouts(nproc: int, runs: list[dict], spec: Path, timeout: int = 900) -> None:
    """Train every {"config", "resume"?} of `runs` in turn in one torchrun launch of `nproc` workers."""
    spec.write_text(json.dumps(runs))
    proc = torchrun(nproc, WORKER, str(spec), timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def metrics(run: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, one per logged step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run) -> dict:
    """The weights of a run's latest checkpoint, read back in this one process whatever the layout."""
    return {name: p.detach() for name, p in load_model(run)[1].named_parameters()}


def assert_weights_match(ours: dict, ref: dict) -> None:
    """Final weights agree element for element, except a few entries whose gradient is a near-cancelling
    sum: summing per-rank partial sums changes its last bits, and Adam's m/sqrt(v) turns that into a step
    of up to about lr. So: nearly every element within 1e-4, and each tensor within 1e-3 in relative
    norm (a missing or wrong reduction moves every element by far more)."""
    assert ours.keys() == ref.keys()
    for name in ref:
        close = torch.isclose(ours[name], ref[name], rtol=1e-4, atol=5e-5)
        assert close.float().mean() >= 0.998, (name, int((~close).sum()))
        assert (ours[name] - ref[name]).norm() <= 1e-3 * ref[name].norm(), name


MODEL_STATES = ("parameters", "gradients", "optimizer_states")


def measured_memory(nproc: int, preset: str, *overrides: str) -> dict:
    """`fivefold memory --nproc N --json` on random tokens: rank 0's rows (category -> predicted,
    measured, error)."""
    cmd = [sys.executable, "-m", "fivefold", "memory", "--preset", preset, "--synthetic", "--steps", "2", "--json",
           "--nproc", str(nproc)]
    for override in overrides:
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row["category"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])["comparison"]}


def assert_matches_plan(rows: dict, activations: bool = True) -> None:
    """Model states within 1% of the plan, activations within 5%."""
    checks = [(name, 0.01) for name in MODEL_STATES] + ([("activations", 0.05)] if activations else [])
    for name, tolerance in checks:
        assert abs(rows[name]["error"]) <= tolerance, rows[name]
