"""The step-time model against measured steps on this machine: calibrate it (`fivefold calibrate --nproc 2`,
one thread per process), train each CPU layout for a few steps (`fivefold train`, real data, one thread
per process), and compare the fastest measured step (outside load only slows a step down; the first step
warms up and is dropped) with the prediction from the calibrated profile.

    OMP_NUM_THREADS=1 python bench/planner_cpu.py --json bench/results/planner_cpu.json   # ~6 min, quiet machine

The JSON keeps the profile, each layout's overrides and measured step times, so tests/test_speed_model.py
re-predicts them with the current model and checks every layout stays within +-25% (no timing in the test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE = ["model.num_layers=4", "train.seq_len=128", "train.micro_batch_size=4", "train.precision=fp32",
        "train.eval_every=100000", "train.log_every=1", "train.save_every=0", "train.tensorboard=false",
        "train.progress=false", "train.warmup_steps=1"]
LAYOUTS = {
    "1 process": (1, ["train.grad_accum=2"]),
    "1 process, recompute=full": (1, ["train.grad_accum=2", "train.recompute=full"]),
    "1 process, recompute=ops": (1, ["train.grad_accum=2", "train.recompute=ops"]),
    "dp=2": (2, ["parallel.dp=2", "train.grad_accum=2"]),
    "tp=2": (2, ["parallel.tp=2", "train.grad_accum=2"]),
    "pp=2 1f1b": (2, ["parallel.pp=2", "train.grad_accum=4", "parallel.pp_schedule=1f1b"]),
    "pp=2 zero-bubble": (2, ["parallel.pp=2", "train.grad_accum=4", "parallel.pp_schedule=zero-bubble"]),
    "cp=2": (2, ["parallel.cp=2", "train.grad_accum=2"]),
    "dp=2 zero=3": (2, ["parallel.dp=2", "parallel.zero=3", "train.grad_accum=2"]),
}
PRESET = "bench-30m"


def measure(nproc: int, overrides: list[str], steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        sets = [a for o in [*BASE, *overrides, f"train.steps={steps}", f"train.out_dir={out}"] for a in ("--set", o)]
        cmd = [sys.executable, "-m", "fivefold", "train", "--preset", PRESET, *sets]
        if nproc > 1:
            cmd += ["--nproc", str(nproc)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time"] for r in records if "step_time" in r]


def predict(profile: dict, overrides: list[str]) -> dict:
    from fivefold.config_load import load_config
    from fivefold.planner.hardware import profile_from_dict
    from fivefold.planner.speed import predict_step

    cfg = load_config(preset=PRESET, overrides=[*BASE, *overrides])
    return predict_step(cfg, profile_from_dict(profile, "bench/results/planner_cpu.json")).to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import tomllib

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu.toml"
        subprocess.run([sys.executable, "-m", "fivefold", "calibrate", "--nproc", "2", "--out", str(path)],
                       check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        profile = tomllib.loads(path.read_text())
    rows = []
    print(f"{'layout':26s} {'measured':>10s} {'predicted':>10s} {'error':>8s}")
    for name, (nproc, overrides) in LAYOUTS.items():
        times = measure(nproc, overrides, args.steps)[1:]  # the first step warms up
        measured = min(times)
        predicted = predict(profile, overrides)
        error = predicted["step_time_s"] / measured - 1
        rows.append({"layout": name, "nproc": nproc, "overrides": overrides, "measured_step_s": times,
                     "measured_s": measured, "predicted": predicted, "error": error})
        print(f"{name:26s} {measured:>9.3f}s {predicted['step_time_s']:>9.3f}s {100 * error:>+7.1f}%", flush=True)
    result = {"preset": PRESET, "base": BASE, "profile": profile, "layouts": rows,
              "max_abs_error": max(abs(r["error"]) for r in rows)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
