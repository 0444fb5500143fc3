"""Helpers for the multi-process parity tests: launching layouts under torchrun, comparing weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fivefold.weights import load_model

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


def gradient_rms(run) -> dict:
    """sqrt of Adam's exp_avg_sq per parameter, from a run's latest checkpoint: each element's gradient RMS."""
    from fivefold.checkpoint.pieces import read_state
    from fivefold.checkpoint.store import resolve_checkpoint

    path = resolve_checkpoint(run)
    moments = {f"optim.{name}.exp_avg_sq": torch.empty_like(w) for name, w in final_weights(run).items()}
    read_state(path, moments)
    return {key[len("optim."):-len(".exp_avg_sq")]: v.sqrt() for key, v in moments.items()}


def assert_weights_match(ours: dict, ref: dict, ref_rms: dict | None = None, lr: float = BASE["train.lr"],
                         steps: int = BASE["train.steps"]) -> None:
    """Final weights agree element for element: within atol 2e-4 + rtol 1e-4 (2% of one Adam step at lr
    1e-2; a wrong or missing reduction moves an element by about lr per step), and each tensor within
    1e-4 in relative norm, over every element whose reference gradient RMS (sqrt of Adam's v, `ref_rms`)
    is at least 1e-4. Below that an element's gradient is a near-cancelling sum whose terms each layout
    adds in another order, and Adam's m / (sqrt(v) + eps) turns its rounding into a step of up to lr
    either way: such elements (e.g. embedding [360, 42] of the 8-layer pipeline model: sqrt(v) = 1.1e-5,
    its row's median 1e-2, off by 1.4 lr under every pipeline schedule) are held to Adam's bound,
    steps x lr. BASE's eps of 1e-6 (not 1e-8) keeps the rest steady. Measured elsewhere: at most 1.0e-4
    off and 4.1e-5 in relative norm."""
    assert ours.keys() == ref.keys()
    for name in ref:
        a, b = ours[name], ref[name]
        steady = ref_rms[name] >= 1e-4 if ref_rms is not None else torch.ones_like(b, dtype=torch.bool)
        torch.testing.assert_close(a[steady], b[steady], rtol=1e-4, atol=2e-4, msg=lambda m: f"{name}: {m}")
        assert (a[steady] - b[steady]).norm() <= 1e-4 * b[steady].norm(), name
        assert (a - b).abs().max() <= steps * lr, name


def assert_parity(run: Path, reference: Path, steps: int = BASE["train.steps"], weights: bool = True) -> None:
    """The parity criterion, step by step against the reference run: the loss within rtol 1e-5; the
    gradient norm within 1e-5 on the first step (the same weights must give the same gradient) and 2e-4
    after it; the validation loss within 1e-5 where both evaluated; then the final weights
    (assert_weights_match). A loss alone can hide a wrong gradient. Why 2e-4 for later gradient norms:
    the tiny model's third step has a gradient spike (norm 8.1 against ~1.4) that amplifies the fp32
    rounding of another micro-batch split; measured up to 1.1e-4 at step 4, back to ~2e-6 by step 5, the
    same for every pipeline schedule, while a wrong or missing reduction is off from the first step."""
    from fivefold.train.compare import compare_metrics, compare_runs, read_metric

    result = compare_runs(run, reference, key="loss", rtol=1e-5)
    assert result.ok and len(result.steps) == steps, f"loss: {result.summary()}"
    ours, ref = read_metric(run, "grad_norm"), read_metric(reference, "grad_norm")
    first = min(ours)
    for chosen, rtol in (([first], 1e-5), (list(ours), 2e-4)):
        result = compare_metrics({s: ours[s] for s in chosen}, {s: ref[s] for s in chosen if s in ref}, rtol=rtol)
        assert result.ok and len(result.steps) == len(chosen), f"grad_norm: {result.summary()}"
    if read_metric(run, "val_loss") and read_metric(reference, "val_loss"):
        result = compare_runs(run, reference, key="val_loss", rtol=1e-5)
        assert result.ok, f"val_loss: {result.summary()}"
    if weights:
        assert_weights_match(final_weights(run), final_weights(reference), gradient_rms(reference))


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


# One (b, S, h) fp32 tensor of the tiny models at micro-batch 2 and sequence 128: a gathered sequence.
WHOLE_SEQUENCE = 4 * 2 * 128 * 64


def assert_matches_plan(rows: dict, activations: bool = True, late: float = 0.0, tolerance: float = 0.005) -> None:
    """Model states within 1% of the plan, activations within `tolerance` (0.5%, as for one process in
    test_memory_measured, where the replay agrees to bytes), the start-up peak at most the plan's. A layout
    that measurably differs more passes its own `tolerance`, with the measured figures beside it.
    `late`: bytes of a buffer that a collective whose result is copied out and dropped at once (SP's gathered
    sequence, EP's sent tokens, the copy tensor parallelism's all-reduce sums) may still hold when the peak
    comes: gloo's worker thread releases the buffers of a finished call a
    moment after the call has returned (measured: 30-40% of all_gather_into_tensor calls), so the measured
    peak may exceed the plan by up to that much, and by no more."""
    if "startup" in rows:  # the plan's start-up peak is a bound (the largest parameter made last)
        assert rows["startup"]["measured"] <= 1.001 * rows["startup"]["predicted"], rows["startup"]
    checks = [(name, 0.01) for name in MODEL_STATES] + ([("activations", tolerance)] if activations else [])
    for name, limit in checks:
        row = rows[name]
        if name == "activations" and late and row["measured"] > row["predicted"]:
            over = row["measured"] - row["predicted"]
            assert over <= late + limit * row["predicted"], row
        else:
            assert abs(row["error"]) <= limit, row
