"""bench/serve_scoring.py end to end on a tiny model: the engine's prompt scores against transformers'
forward over the same weights (the bench's own check), and what it records."""

import json

from bench_modules import bench_module
from fivefold.presets import PRESETS


def test_scores_match_transformers_and_are_recorded(tmp_path, capsys):
    with bench_module("serve_scoring") as bench:
        out_json = tmp_path / "scoring.json"
        out = bench.main(["--model", "tiny", "--prompts", "5", "--shortest", "8", "--longest", "40", "--top", "2",
                          "--batch-sizes", "1,4", "--reps", "1", "--json", str(out_json)])
    prompts = bench.prompts_of(5, 8, 40, PRESETS["tiny"].vocab_size, 0)
    assert out["scored_tokens"] == sum(len(p) - 1 for p in prompts)
    assert out["max_abs_logprob_diff"] < 1e-4  # fp32: the same scores on both sides
    assert set(out["transformers_s_by_batch"]) == {1, 4} and out["transformers_best_batch"] in (1, 4)
    assert out["fivefold_tok_s"] > 0 and out["fivefold_prefill_only_s"] > 0
    assert json.loads(out_json.read_text())["scored_tokens"] == out["scored_tokens"]
    assert "fivefold / transformers: " in capsys.readouterr().out
