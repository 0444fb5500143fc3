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


def test_where_greedy_outputs_part_the_gap_is_read_from_transformers():
    """bench/serve.py's explanation of a request whose tokens differ from transformers': the first differing
    output token, and the two tokens' distance in transformers' logprobs after the prompt and the shared prefix
    (a near tie is either side's fair pick); nothing for equal outputs; no gap where one side stopped early."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with bench_module("serve", "serve_bench") as bench:
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)).eval()
        requests = [bench.Request([1, 2, 3], 4), bench.Request([5, 6], 4), bench.Request([7], 4)]
        ours = [[9, 9, 9, 9], [10, 11, 12, 13], [1, 2]]
        theirs = [[9, 9, 9, 9], [10, 11, 40, 13], [1, 2, 3]]
        found = bench.splits(hf, requests, ours, theirs)
    assert [(x["request"], x["step"]) for x in found] == [(1, 2), (2, 2)] and found[1]["logprob_gap"] is None
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(input_ids=torch.tensor([[5, 6, 10, 11]])).logits[0, -1].float(), -1)
    assert found[0]["logprob_gap"] == abs(logprobs[12] - logprobs[40]).item() > 0
