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
        "train.log_every": 1, "train.save_every": 5, "train.keep_checkpoints": 3, "train.eps": 1e-6}


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
    """Final weights agree element for element: every element within rtol 1e-4 / atol 1e-4 (1% of one
    Adam step at lr 1e-2, where a wrong or missing reduction moves an element by about lr per step)
    and every tensor within 1e-4 in relative norm. BASE trains with Adam's eps at 1e-6 rather than 1e-8,
    still far below real gradients: an element whose gradient is a near-cancelling sum (whose terms each
    layout adds in another order) then steps in proportion to that sum, instead of a full +-lr step from
    m / sqrt(v) = +-1 that turns rounding noise into a 0.4 lr difference. Measured over the parity runs
    (10 steps): at most 5.4e-5 off (an embedding row under tp=2) and 4.1e-5 in relative norm (GPT-2's
    k_proj bias, whose exact gradient is zero: softmax ignores a shift of every score)."""
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        assert (ours[name] - ref[name]).norm() <= 1e-4 * ref[name].norm(), name


def assert_parity(run: Path, reference: Path, steps: int = BASE["train.steps"], weights: bool = True) -> None:
    """The parity criterion: every step's loss (rtol 1e-5) and gradient norm (rtol 1e-4: a norm of sums
    whose terms each layout adds in another order; observed up to 1.5e-5, where a wrong or missing
    reduction changes it by a large fraction) equal the reference run's, and the final weights match
    (assert_weights_match). A loss alone can hide a wrong gradient. Where both runs evaluated, their
    validation losses agree too (rtol 1e-5)."""
    from fivefold.train.compare import compare_runs, read_metric

    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        result = compare_runs(run, reference, key=key, rtol=rtol)
        assert result.ok and len(result.steps) == steps, f"{key}: {result.summary()}"
    if read_metric(run, "val_loss") and read_metric(reference, "val_loss"):
        result = compare_runs(run, reference, key="val_loss", rtol=1e-5)
        assert result.ok, f"val_loss: {result.summary()}"
    if weights:
        assert_weights_match(final_weights(run), final_weights(reference))


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
