"""bench/quant_dequantize.py end to end on the tiny preset: dequantize as it runs agrees bit for bit with the
whole-weight formula, holds what dequantized_bytes plans and less than the whole weight's formula, and what it
records."""

import json

from bench_modules import bench_module


def test_dequantize_agrees_holds_its_plan_and_is_recorded(tmp_path):
    with bench_module("quant_dequantize") as bench:
        out_json = tmp_path / "dequantize.json"
        out = bench.main(["--preset", "tiny", "--reps", "1", "--group-size", "16", "--json", str(out_json)])
    rows = out["rows"]
    assert len(rows) == 4 * 2 * 2  # linears x methods x dtypes
    for row in rows:
        assert row["same"] and row["chunked_peak"] == row["planned"], row
        assert row["chunked_peak"] < row["whole_peak"], row
    assert json.loads(out_json.read_text())["rows"] == rows
