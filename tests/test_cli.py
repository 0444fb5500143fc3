"""End to end through the real entry point: `python -m fivefold train`, then `generate`."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch


def fivefold(*args, cache, check=True):
    env = {**os.environ, "FIVEFOLD_CACHE": cache}
    proc = subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"fivefold {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


TRAIN = ["train", "--preset", "tiny", "--set", "train.steps=40", "--set", "train.seq_len=64",
         "--set", "train.micro_batch_size=8", "--set", "train.warmup_steps=5", "--set", "train.log_every=5",
         "--set", "train.eval_every=20", "--set", "train.peak_flops=1e11", "--set", "train.lr=1e-2"]


def test_train_then_generate(data_cache, tmp_path):
    out = tmp_path / "run"
    proc = fivefold(*TRAIN, "--out", str(out), cache=data_cache)
    assert "139,584 parameters" in proc.stdout and "validation loss" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30, 35, 40]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
        assert all(key in r for r in records), key
    # It learns: from ln(512) = 6.24 for a uniform prediction to well below it.
    assert records[-1]["val_loss"] < math.log(512) - 0.7
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]

    gen = fivefold("generate", "--checkpoint", str(out), "--prompt", "The for statement", "--max-new-tokens",
                   "12", "--temperature", "0.8", "--seed", "1", cache=data_cache)
    assert gen.stdout.startswith("The for statement") and len(gen.stdout) > len("The for statement")
    greedy = [fivefold("generate", *source, "--prompt", "Return the", "--temperature", "0",
                       "--max-new-tokens", "8", cache=data_cache).stdout
              for source in (["--checkpoint", str(out)], [str(out)])]  # the flag and the positional agree
    assert greedy[0] == greedy[1]

    # score: the text's log-likelihood is the trained model's full forward over its tokens.
    text = "def add(x, y):\n    return x + y\n"
    scored = fivefold("score", str(out), "--text", text, "--per-token", cache=data_cache).stdout
    from fivefold.serve.loading import load_model_for_serving  # the test process's own copy of the model
    loaded = load_model_for_serving(out, None, "float32", torch.device("cpu"), 1)
    ids = loaded.tokenizer.encode(text).ids
    with torch.no_grad():
        logprobs = torch.log_softmax(loaded.model(torch.tensor([ids]))[0, :-1].float(), dim=-1)
    total = float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
    summary = scored.splitlines()[-1]
    assert summary.startswith(f"scored {len(ids) - 1} of {len(ids)} tokens in 1 window(s) of up to ")
    assert float(summary.split("log-likelihood ")[1].split()[0]) == pytest.approx(total, abs=1e-3)
    assert float(summary.split("perplexity ")[1]) == pytest.approx(math.exp(-total / (len(ids) - 1)), rel=1e-4)
    assert len(scored.splitlines()) == len(ids) + 1  # a header, a line per scored token, the summary

    # --dtype bfloat16: the engine in bfloat16, so the same text scores to bfloat16's rounding, not float32's bits.
    half = fivefold("score", str(out), "--text", text, "--dtype", "bfloat16", cache=data_cache).stdout
    total_bf16 = float(half.splitlines()[-1].split("log-likelihood ")[1].split()[0])
    assert total_bf16 != pytest.approx(total, abs=1e-3) and total_bf16 == pytest.approx(total, rel=0.03)
    gen_bf16 = fivefold("generate", str(out), "--prompt", "Return the", "--temperature", "0", "--max-new-tokens", "8",
                        "--dtype", "bfloat16", cache=data_cache).stdout
    assert gen_bf16.startswith("Return the")
    # In windows of 8 tokens, 3 apart: each token once, with the context its window gives it.
    windowed = fivefold("score", str(out), "--text", text, "--window", "8", "--stride", "3", cache=data_cache).stdout
    expected, starts = 0.0, range(0, len(ids) - 1, 3)
    with torch.no_grad():
        for n, start in enumerate(starts):
            piece = ids[start:start + 8]
            window_lp = torch.log_softmax(loaded.model(torch.tensor([piece]))[0, :-1].float(), dim=-1)
            first = 0 if n == 0 else 4  # the rows of tokens no earlier window scored: the last 3 (the first: all 7)
            expected += float(window_lp.gather(1, torch.tensor(piece[1:])[:, None])[first:].sum())
            if start + len(piece) >= len(ids):
                break
    summary = windowed.splitlines()[-1]
    assert summary.startswith(f"scored {len(ids) - 1} of {len(ids)} tokens in {n + 1} window(s) of up to 8, 3 apart:")
    assert float(summary.split("log-likelihood ")[1].split()[0]) == pytest.approx(expected, abs=1e-3)

    again = fivefold(*TRAIN, "--out", str(out), cache=data_cache)  # resumes: nothing left to do
    assert "already at step 40" in again.stdout
    refused = fivefold(*TRAIN, "--out", str(out), "--no-resume", cache=data_cache, check=False)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr


def test_bad_config_is_a_clear_error_before_anything_starts(data_cache, tmp_path):
    proc = fivefold("train", "--set", "model.num_kv_heads=3", "--out", str(tmp_path), cache=data_cache, check=False)
    assert proc.returncode == 2
    assert "model.num_kv_heads=3 must divide model.num_heads=8" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_presets_lists_real_counts(data_cache):
    assert "8,030,261,248" in fivefold("presets", cache=data_cache).stdout
