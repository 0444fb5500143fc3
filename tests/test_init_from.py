"""train.init_from: start training from a Hugging Face model directory (streamed into each rank's shards,
one tensor slice at a time) or from a fivefold checkpoint, in one process and under parallel layouts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

from fivefold.config import Config, ConfigError, ModelConfig  # noqa: E402
from fivefold.config_load import load_config  # noqa: E402
from fivefold.interop.hf import config_from_hf, import_hf  # noqa: E402
from fivefold.memory.formulas import count_params  # noqa: E402
from fivefold.weights import load_model  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402
from parity import BASE, assert_parity, launch_layouts  # noqa: E402

HF = {  # 512 tokens: the tiny preset's tokenizer, so the embedded corpus feeds them
    "llama": lambda: LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=0, eos_token_id=0),
    "gpt2": lambda: GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                               eos_token_id=0),
}


def config(cache, out, init_from, model=None, **overrides) -> Config:
    values = {**BASE, "data.cache_dir": cache, "train.out_dir": str(out), "train.init_from": str(init_from),
              "train.micro_batch_size": 8, **overrides}
    cfg = load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])
    if model is not None:
        cfg.model = model
    return cfg


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, make in HF.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # norms and biases off their 1 / 0 init, so a mis-mapped one shows
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / name, safe_serialization=True)
    return root


def hf_model_config(path):
    return config_from_hf(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("name", list(HF))
def test_one_process_starts_from_exactly_the_imported_weights(hf_dirs, data_cache, tmp_path, name):
    src = hf_dirs / name
    trainer = Trainer(config(data_cache, tmp_path / "run", src, hf_model_config(src)), quiet=True)
    _, imported = import_hf(src)
    ours, ref = dict(trainer.model.named_parameters()), dict(imported.named_parameters())
    assert ours.keys() == ref.keys()
    for n in ref:
        assert torch.equal(ours[n], ref[n]), n


def test_a_checkpoint_restarts_with_its_weights_and_a_fresh_optimizer(data_cache, tmp_path):
    first = Trainer(config(data_cache, tmp_path / "a", "", **{"train.steps": 3}), quiet=True)
    first.fit()
    second = Trainer(config(data_cache, tmp_path / "b", tmp_path / "a"), quiet=True)
    _, saved = load_model(tmp_path / "a")
    for (n, p), (m, q) in zip(second.model.named_parameters(), saved.named_parameters()):
        assert n == m and torch.equal(p, q), n
    assert second.step == 0 and not second.optimizer.moment(second.optimizer.masters[0], "exp_avg").any()


def test_a_run_started_from_another_takes_its_model_shape(data_cache, tmp_path):
    """train.init_from=RUN and no model settings (no preset, no model.* key): the run is the source's model,
    from its weights, in the trainer and in `fivefold plan` alike."""
    first = Trainer(config(data_cache, tmp_path / "a", "", **{"train.steps": 2}), quiet=True)  # the tiny preset
    first.fit()
    assert first.cfg.model != ModelConfig()
    values = {**BASE, "data.cache_dir": data_cache, "train.out_dir": str(tmp_path / "b"),
              "train.init_from": str(tmp_path / "a"), "train.micro_batch_size": 8}
    overrides = [f"{k}={v}" for k, v in values.items()]
    cfg = load_config(overrides=overrides)
    assert cfg.model == ModelConfig()
    second = Trainer(cfg, quiet=True)
    assert second.cfg.model == first.cfg.model
    _, saved = load_model(tmp_path / "a")
    for (n, p), (m, q) in zip(second.model.named_parameters(), saved.named_parameters()):
        assert n == m and torch.equal(p, q), n
    plan = subprocess.run([sys.executable, "-m", "fivefold", "plan", *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert f"parameters: {count_params(first.cfg.model):,d}" in plan.stdout


def test_mismatched_shapes_are_refused_with_the_setting_to_change(hf_dirs, data_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"model.hidden_size=64 but the config says 128; use --set model.hidden_size=64"):
        Trainer(config(data_cache, tmp_path / "run", hf_dirs / "llama", **{"model.hidden_size": 128}), quiet=True)
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(config(data_cache, tmp_path / "run", tmp_path / "nowhere"), quiet=True)


LAYOUTS = {"tp2": {"parallel.tp": 2}, "dp2_zero3": {"parallel.dp": 2, "parallel.zero": 3, "train.micro_batch_size": 4},
           "pp2": {"parallel.pp": 2, "train.micro_batch_size": 4, "train.grad_accum": 2}}


def test_every_layout_trains_like_one_process_from_the_same_weights(hf_dirs, data_cache, tmp_path):
    """From a Hugging Face directory (Llama and GPT-2 layouts: fused q/k/v, transposed Conv1D) and from a
    fivefold checkpoint: tp=2, dp=2 ZeRO-3 and pp=2 each match the one-process run from the same source."""
    sources = {name: (hf_dirs / name, hf_model_config(hf_dirs / name)) for name in HF}
    Trainer(config(data_cache, tmp_path / "seed_run", "", **{"train.steps": 2}), quiet=True).fit()
    sources["fivefold"] = (tmp_path / "seed_run", None)
    runs = []
    for source, (src, model) in sources.items():
        Trainer(config(data_cache, tmp_path / f"{source}_single", src, model), quiet=True).fit()
        for lay, overrides in LAYOUTS.items():
            runs.append({"config": config(data_cache, tmp_path / f"{source}_{lay}", src, model, **overrides).to_dict()})
    launch_layouts(2, runs, tmp_path / "runs.json")
    for source in sources:
        for lay in LAYOUTS:
            assert_parity(tmp_path / f"{source}_{lay}", tmp_path / f"{source}_single")
