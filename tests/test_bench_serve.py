"""bench/serve.py end to end on a tiny model (no transformers reference, no roofline): the engine's other
paths (--paths) and quantized weights (--quant) beside the main run, and the GPU summary of that file."""

import json

from bench_modules import bench_module


def test_paths_and_quantized_weights_beside_the_main_run(tmp_path, capsys):
    with bench_module("serve", "serve_bench") as bench:  # with serve_client, gpu_summary
        out_json = tmp_path / "serve.json"
        out = bench.main(["--model", "tiny", "--requests", "6", "--max-prompt", "48", "--max-output", "12",
                          "--skip-hf", "--skip-roofline", "--decode-reps", "1", "--decode-prompt", "16",
                          "--decode-output", "8", "--paths", "--quant", "int8", "--json", str(out_json)])
        import gpu_summary

        gpu_summary.main(["serve", str(out_json)])
    printed = capsys.readouterr().out
    paths = out["paths"]
    # On a CPU there are no graphs: the eager-decode variant is the main run, and is left out.
    assert list(paths) == ["LoRA loaded, base requests", "LoRA on every request"]
    assert "fused q/k/v and gate/up: 4 modules" in out["engine_path"]  # the tiny preset: 2 layers, 2 each
    for v in paths.values():
        assert "fused q/k/v and gate/up: 0 modules" in v["engine_path"]  # the adapters hook the separate products
        assert v["output_tokens_per_s"] > 0 and v["decode_batch1"]["best"] > 0
    # Base requests through the adapter's engine are the base model's tokens; the adapter changes them.
    assert paths["LoRA loaded, base requests"]["requests_matching_fivefold"] == 6
    assert paths["LoRA on every request"]["requests_matching_fivefold"] < 6
    assert len(out["quantized"]["int8"]["token_ids"]) == 6
    stored = json.loads(out_json.read_text())
    assert stored["stage"] == "done" and set(stored["paths"]) == set(paths)
    assert "LoRA on every request: " in printed and "the engine's other paths" in printed
    assert "int8: " in printed and "weight bytes: float32 " in printed
