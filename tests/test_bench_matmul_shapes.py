"""bench/matmul_shapes.py: the step's products timed against the step-time model's price, and the knee fit."""

import json
import math
from pathlib import Path

import pytest
import torch
from bench_modules import bench_module

from fivefold.planner.hardware import load_profile
from fivefold.planner.speed import matmul_seconds

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    with bench_module("matmul_shapes") as module:
        yield module


def test_the_fit_recovers_the_knee_and_efficiency_that_made_the_times(bench):
    shapes = [(32768, 2048, n) for n in (512, 2048, 3072, 8192)] + [(512, 32768, 2048), (16384, 576, 192)]
    seconds = [matmul_seconds(*s, 989e12, 0.62, 264) for s in shapes]
    knee, eff, rms = bench.fit_knee(shapes, seconds, 989e12)
    assert knee == 264 and eff == pytest.approx(0.62, rel=1e-9) and rms < 1e-9
    # one knee cannot make these: the fit is the best compromise, with the error it leaves
    seconds[0] *= 2
    assert bench.fit_knee(shapes, seconds, 989e12)[2] > 0.1


@pytest.mark.parametrize("which", ["forward", "grad_input", "grad_weight"])
def test_each_pass_multiplies_operands_of_its_shape(bench, which):
    m, k, n = bench.pass_shape(40, 24, 56, which)
    a, b = bench.operands(40, 24, 56, which, "cpu", torch.float32)
    assert a.shape == (m, k) and b.shape == (k, n)
    # the layouts autograd hands the products: forward multiplies by W^T, the weight gradient by g^T
    assert (which == "forward") == (not b.is_contiguous()) and (which == "grad_weight") == (not a.is_contiguous())


def test_a_cpu_run_times_and_prices_every_linear_pass(bench, tmp_path):
    out = tmp_path / "m.json"
    bench.main(["--device", "cpu", "--rows", "tiny:64", "--cluster", "h100-sxm", "--reps", "1", "--json", str(out)])
    d = json.loads(out.read_text())
    names = {r["linear"] for r in d["rows"]}
    assert names == {"q", "k", "qkv", "o", "gate", "gate_up", "down", "head"} and len(d["rows"]) == 3 * len(names)
    for r in d["rows"]:
        assert r["seconds"] > 0 and r["flops_per_s"] == pytest.approx(2 * math.prod(r["shape"]) / r["seconds"])
        assert r["error"] == pytest.approx(r["seconds"] / r["predicted_seconds"] - 1)
    assert d["fit"]["profile_knee"] == load_profile("h100-sxm").matmul_knee and d["fit"]["rms_log_error"] <= d["fit"]["profile_rms_log_error"] + 1e-12


@pytest.mark.parametrize("argv", [["--rows", "bench-30m"], ["--rows", "nosuch:64"], ["--rows", "tiny:0"],
                                  ["--cluster", "nosuch"]])
def test_bad_rows_or_profile_are_refused_with_one_line(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].split(": error: ")[1].startswith("--")
