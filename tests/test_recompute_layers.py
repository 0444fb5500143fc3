"""Recomputation of some layers only (train.recompute_layers): the chosen blocks, and only they, are
recomputed; gradients are those of no recomputation; the plan's activation figure follows the pattern
exactly (measured); `fivefold plan --sweep recompute` draws the memory / compute line."""

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.config_checks import recompute_layer_set
from fivefold.config_load import load_config
from fivefold.memory.plan import plan_memory
from fivefold.train.trainer import Trainer
from test_memory_measured import assert_matches_plan, measure
from test_train import first_batch, grads


@pytest.mark.parametrize("spec, layers", [("", {0, 1, 2, 3, 4}), ("every:2", {0, 2, 4}), ("every:3", {0, 3}),
                                          ("every:9", {0}), ("1, 4", {1, 4}), ("0", {0})])
def test_layer_specs(spec, layers):
    assert recompute_layer_set(spec, 5) == layers


@pytest.mark.parametrize("spec, message", [("every:0", "every:k"), ("every:x", "every:k"), ("1,a", "layer indices"),
                                           ("0,5", "outside 0..4")])
def test_bad_layer_specs_are_rejected(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=["model.num_layers=5", "train.recompute=full",
                                              f"train.recompute_layers={spec}"])


def test_layers_without_a_recompute_mode_are_rejected():
    with pytest.raises(ConfigError, match="needs train.recompute=selective, ops or full"):
        load_config(preset="tiny", overrides=["train.recompute_layers=every:2"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_only_the_chosen_blocks_recompute_and_gradients_are_unchanged(tiny_config, mode, tmp_path):
    plain = Trainer(tiny_config(**{"model.num_layers": 4, "model.attention": "eager"}), quiet=True)
    some = Trainer(tiny_config(**{"model.num_layers": 4, "model.attention": "eager", "train.recompute": mode,
                                  "train.recompute_layers": "every:2", "train.out_dir": str(tmp_path / "some")}),
                   quiet=True)
    wrapped = [("forward" in vars(block if mode == "full" else block.attn.core)) for block in some.model.layers]
    assert wrapped == [True, False, True, False]
    losses = [t.accumulate_gradients(*first_batch(t, 1)) for t in (some, plain)]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    torch.testing.assert_close(grads(some), grads(plain), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("overrides", [
    ("train.recompute=full", "train.recompute_layers=every:2"),
    ("train.recompute=full", "train.recompute_layers=1,2", "train.precision=bf16-mixed"),
    ("train.recompute=selective", "train.recompute_layers=every:3", "model.attention=eager"),
])
def test_measured_memory_matches_the_plan(overrides):
    assert_matches_plan(measure("tiny", "model.num_layers=4", *overrides))


def test_activations_fall_linearly_with_the_recomputed_layers():
    def activations(spec: str) -> float:
        cfg = load_config(preset="llama3-8b", overrides=["train.precision=bf16-mixed", "train.micro_batch_size=1",
                                                         "train.seq_len=4096", "train.recompute=full",
                                                         f"train.recompute_layers={spec}"])
        return plan_memory(cfg, suggest=False).memory["activations"]

    every = {k: activations(f"every:{k}") for k in (1, 2, 4, 8)}  # 32, 16, 8 and 4 layers recomputed
    assert every[1] < every[2] < every[4] < every[8]
    step = every[4] - every[2]  # 8 more layers recomputed
    assert every[8] - every[4] == pytest.approx(step / 2, rel=1e-9)
    assert every[2] - every[1] == pytest.approx(2 * step, rel=0.02)  # the last block's recompute peak aside


def test_sweep_cli(tmp_path, capsys):
    png = tmp_path / "recompute.png"
    assert main(["plan", "--preset", "llama3-8b", "--set", "train.precision=bf16-mixed", "--set",
                 "train.micro_batch_size=1", "--set", "train.seq_len=8192", "--sweep", "recompute", "--png", str(png),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert "note" not in out  # train.compile=auto compiles on CUDA, and every row replays compiled blocks
    assert png.stat().st_size > 10_000
    line = [r for r in rows if r["recompute"] != "selective"]
    assert [r["recompute"] for r in line][0] == "none" and line[-1]["recompute"] == "full"
    assert all(a["activations"] > b["activations"] and a["extra_compute"] < b["extra_compute"]
               for a, b in zip(line, line[1:]))
    assert line[-1]["extra_compute"] == pytest.approx(0.31, abs=0.02)  # one more forward of every layer


def test_sweep_compares_eager_rows_where_the_compiled_replay_stops(capsys):
    """fp8 (and LoRA) blocks are replayed compiled only without recomputation: a sweep of them compares
    eager blocks in every row and says so; its rows then equal an eager sweep's."""
    base = ["plan", "--preset", "llama3.2-1b", "--set", "train.precision=fp8", "--set", "train.micro_batch_size=1",
            "--set", "train.seq_len=2048", "--sweep", "recompute", "--values", "4,2,1", "--json"]
    assert main(base) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert "replay eager blocks" in compiled["note"]
    assert main([*base, "--set", "train.compile=false"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert "note" not in eager and compiled["rows"] == eager["rows"]
