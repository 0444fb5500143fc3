"""bench/cpu_kernels_ab.py on small copies: both sides timed for every case asked for, the ratios written; a
revision whose kernels are this checkout's is this checkout's build (no second build)."""

import json
import subprocess
from pathlib import Path

import pytest
from bench_modules import bench_module

from fivefold.kernels import cpu_build

ROOT = Path(__file__).resolve().parent.parent


def test_two_sides_timed_in_turn(tmp_path, capsys):
    if cpu_build.build()[0] is None:
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_build.build()[1]}")
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "fivefold/kernels"], cwd=ROOT).returncode
    if changed:
        pytest.skip("the kernels differ from HEAD's here: comparing them would build HEAD's (a minute)")
    with bench_module("cpu_kernels_ab") as bench:
        out = bench.main(["--base", "HEAD", "--rounds", "1", "--bytes", "4e6", "--dtypes", "bfloat16",
                          "--json", str(tmp_path / "ab.json")])
    assert "the kernels at HEAD are this checkout's" in capsys.readouterr().out
    assert [(a["rows"], a["tokens"]) for a in out["attention"]] == bench.ATTENTION
    assert {(r["shape"], r["rows"]) for r in out["rows"]} == {(s, n) for s in ("qkv", "o", "gate_up", "down", "lm_head")
                                                               for n in bench.ROWS}
    for case in out["attention"] + out["rows"]:
        assert case["dtype"] == "bfloat16" and case["us"]["base"] > 0 and case["us"]["this"] > 0
        assert case["ratio"] == pytest.approx(case["us"]["this"] / case["us"]["base"])
    assert json.loads((tmp_path / "ab.json").read_text())["base"] == "HEAD"
