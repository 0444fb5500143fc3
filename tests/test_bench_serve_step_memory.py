"""bench/serve_step_memory.py end to end on a tiny model: each step's planned working set bounds what it held
(the bench's own check), tightly where the step is the phase's worst case, and what it records."""

import json

from bench_modules import bench_module


def test_planned_bounds_measured_and_is_recorded(tmp_path):
    with bench_module("serve_step_memory") as bench:
        out_json = tmp_path / "step.json"
        out = bench.main(["--model", "tiny", "--max-model-len", "512", "--max-num-batched-tokens", "256",
                          "--max-num-seqs", "16", "--max-scored-tokens", "64", "--json", str(out_json),
                          # the MLP four times the width, as in Llama-shaped models: the first chunk's peak is
                          # then in the MLP (at tiny's twice, SwiGLU as one C++ call holds less than RoPE does)
                          "--set", "model.ffn_hidden_size=256"])
    ratios = {r["step"]: r["planned_over_measured"] for r in out["rows"]}
    assert set(ratios) == {"first chunk", "long context", "sampling", "scoring"}
    assert all(r >= 1 for r in ratios.values()), ratios  # a bound
    # The worst cases of their phases: the plan within 1% of the first chunk (the MLP) and the long one (its mask
    # and the context's keys and values), 4% of the sampler (its few fixed kilobytes on a 512-token vocabulary).
    assert ratios["first chunk"] < 1.01 and ratios["long context"] < 1.01 and ratios["sampling"] < 1.04
    assert out["path"] == "lean-cpp" and json.loads(out_json.read_text())["rows"] == out["rows"]
