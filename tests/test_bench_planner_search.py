"""bench/planner_search.py: the layout search with the event-driven pipeline simulation and with the plain
sweep rank the same layouts with the same figures (the bench asserts it), and the bench reports both times."""

import json
import sys

from bench_modules import bench_module


def test_both_searches_rank_alike_and_are_timed(tmp_path, monkeypatch):
    out = tmp_path / "search.json"
    monkeypatch.setattr(sys, "argv", ["planner_search.py", "--case", "qwen2.5-0.5b:8", "--json", str(out)])
    with bench_module("planner_search") as bench:
        bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "qwen2.5-0.5b:8" and row["layouts"] > 10
    assert row["event_driven_s"] > 0 and row["sweep_s"] > 0
    assert row["speedup"] == row["sweep_s"] / row["event_driven_s"]
