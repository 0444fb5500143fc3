"""bench/serve_sampling.py end to end on random logits: the filters keep what a full sort of each row keeps
and what transformers' warpers keep (the bench's own checks), peaked rows' nuclei fall within the candidates,
flat rows' do not, and what it records."""

import json

from bench_modules import bench_module


def test_filters_agree_and_are_recorded(tmp_path):
    with bench_module("serve_sampling") as bench:
        out_json = tmp_path / "sampling.json"
        out = bench.main(["--rows", "8", "--vocab", "4000", "--reps", "1", "--json", str(out_json),
                          "--draw-rows", "12", "--draw-vocab", "20000", "--draw-budget-mib", "2"])
    peaked, flat = out["filters"]["peaked"], out["filters"]["flat"]
    for row in peaked + flat:
        assert row["same_kept_as_sorting_all"] and row["rows"] == 8
        assert row["rows_kept_as_transformers"] >= 7  # a row may differ by rounding at the nucleus's edge
    assert peaked[0]["rows_past_candidates"] == 0 and flat[0]["rows_past_candidates"] == 8
    assert flat[1]["nucleus_max"] <= 50  # top-k 50 first
    assert json.loads(out_json.read_text())["filters"]["flat"] == flat
    draws = out["draws"]  # 12 flat rows drawn at once and a few at a time: the same tokens, the planned peak
    assert draws["same_tokens"] and draws["one_pass"]["rows_at_once"] == 12 and draws["chunked"]["rows_at_once"] == 3
    assert draws["chunked"]["peak_bytes"] < 0.3 * draws["one_pass"]["peak_bytes"]
    for side in ("one_pass", "chunked"):
        assert draws[side]["planned_bytes"] >= draws[side]["peak_bytes"] > 0.95 * draws[side]["planned_bytes"]
