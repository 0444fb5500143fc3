"""bench/matmul_sustained.py: a product run back to back in timed chunks, rated by window (on a CPU here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import matmul_sustained  # noqa: E402


def test_windows_weigh_each_chunk_by_its_time_and_average_the_sensors():
    chunks = [{"t": 0.0, "reps": 2, "seconds": 1.0, "clock_mhz": 1900.0},
              {"t": 0.5, "reps": 2, "seconds": 3.0, "clock_mhz": 1700.0},
              {"t": 1.2, "reps": 4, "seconds": 0.5}]
    rows = matmul_sustained.windows(chunks, 1.0, flops=10.0)
    assert [r["start_s"] for r in rows] == [0.0, 1.0]
    assert rows[0]["flops_per_s"] == pytest.approx(10.0 * 4 / (2 * 1.0 + 2 * 3.0))  # 40 FLOPs over 8 s
    assert rows[0]["clock_mhz"] == pytest.approx(1800.0)
    assert rows[1]["flops_per_s"] == pytest.approx(20.0) and "clock_mhz" not in rows[1]
    assert matmul_sustained.rate(chunks, 10.0) == pytest.approx(80.0 / 10.0)


def test_a_short_cpu_run_reports_every_window_and_the_ratios(tmp_path):
    out = matmul_sustained.main(["--device", "cpu", "--size", "48", "--seconds", "0.6", "--window", "0.1",
                                 "--tail", "0.2", "--json", str(tmp_path / "r.json")])
    assert len(out["windows"]) >= 2  # ~6 on an idle machine; chunks timed before a busy one's slow down take longer
    assert [w["start_s"] for w in out["windows"]] == sorted(w["start_s"] for w in out["windows"])
    assert all(w["flops_per_s"] > 0 for w in out["windows"])
    assert out["sustained_over_brief"] == pytest.approx(out["sustained_flops_per_s"] / out["brief_flops_per_s"])
    assert out["sustained_over_first"] == pytest.approx(out["sustained_flops_per_s"] / out["first_flops_per_s"])
    assert (tmp_path / "r.json").is_file()
