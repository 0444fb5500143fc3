"""LoRA (fivefold.finetune.lora): step 0 is the base model exactly, only the adapters train and hold optimizer
states (as the plan says), a LoRA run's checkpoint serves as the merged model, it resumes exactly, and every
layout (dp + ZeRO-1/2, tp with and without SP, pp with 1F1B and zero-bubble, tp x dp) gives the losses,
gradient norms and adapter weights of one process."""

import math

import pytest
import torch

from fivefold.config import ConfigError
from fivefold.config_load import config_from_dict, load_config
from fivefold.finetune.lora import adapter_shapes, is_adapter, read_adapters
from fivefold.memory.formulas import adapter_shapes as planned_adapters
from fivefold.memory.plan import plan_memory
from fivefold.checkpoint.store import resolve_checkpoint
from fivefold.weights import load_model
from fivefold.train.trainer import Trainer
from parity import BASE, launch_layouts

LORA = {"lora.r": 4, "lora.alpha": 8}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data_cache):
    """A briefly trained tiny model: the frozen base every LoRA run here starts from."""
    out = tmp_path_factory.mktemp("lora") / "base"
    values = {**BASE, "data.cache_dir": data_cache, "train.out_dir": str(out), "train.steps": 4,
              "train.save_every": 0, "train.micro_batch_size": 8}
    Trainer(load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]), quiet=True).fit()
    return out


def lora_config(tiny_config, base_run, **overrides):
    return tiny_config(**{**LORA, "train.init_from": str(base_run), **overrides})


def logits(model, ids):
    with torch.no_grad():
        return model(ids).float()


def test_step_zero_is_the_base_model_and_only_adapters_train(tiny_config, base_run):
    trainer = Trainer(lora_config(tiny_config, base_run), quiet=True)
    _, base = load_model(base_run)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(trainer.model, ids), logits(base, ids))  # B = 0: the adapters add exactly zero

    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    shapes = adapter_shapes(trainer.cfg.model, trainer.cfg.lora)
    assert {n: tuple(p.shape) for n, p in trainer.model.named_parameters() if p.requires_grad} == shapes
    assert [(n, math.prod(s)) for n, s in shapes.items()] == planned_adapters(trainer.cfg.model, trainer.cfg.lora)
    assert len(trainer.optimizer.masters) == len(trained)
    assert plan_memory(trainer.cfg).adapters == sum(math.prod(s) for s in shapes.values())

    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.fit(until=2)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())  # the base never moves
    assert all(after[n].grad is None for n in frozen)
    assert any(after[n].abs().sum() > 0 for n in trained if ".lora_B." in n)  # B moved off zero


def test_checkpoint_holds_adapters_and_loads_as_the_merged_model(tiny_config, base_run):
    trainer = Trainer(lora_config(tiny_config, base_run, **{"train.steps": 3}), quiet=True)
    trainer.fit()
    ckpt = resolve_checkpoint(trainer.out_dir)
    adapters = read_adapters(ckpt, trainer.cfg)
    mine = dict(trainer.model.named_parameters())
    assert all(torch.equal(t, mine[n].detach()) for n, t in adapters.items())
    cfg, merged = load_model(trainer.out_dir)
    assert cfg.lora.r == 4 and not any(is_adapter(n) for n, _ in merged.named_parameters())
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(merged, ids), logits(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_resumes_exactly(tiny_config, base_run, tmp_path):
    whole = Trainer(lora_config(tiny_config, base_run, **{"train.steps": 4, "train.out_dir": str(tmp_path / "a")}),
                    quiet=True).fit()
    cfg = lora_config(tiny_config, base_run, **{"train.steps": 4, "train.out_dir": str(tmp_path / "b")})
    Trainer(cfg, quiet=True).fit(until=2)
    resumed = Trainer(cfg, resume=True, quiet=True)
    assert resumed.step == 2
    rest = resumed.fit()
    assert [r["loss"] for r in rest] == [r["loss"] for r in whole[2:]]


def test_lora_run_cannot_be_a_base(tiny_config, base_run, tmp_path):
    first = Trainer(lora_config(tiny_config, base_run, **{"train.steps": 1}), quiet=True)
    first.fit()
    with pytest.raises(ConfigError, match="merge them first"):
        Trainer(lora_config(tiny_config, first.out_dir, **{"train.out_dir": str(tmp_path / "c")}), quiet=True)


@pytest.mark.parametrize("overrides, message", [
    ({"lora.r": -1}, "lora.r=-1"),
    ({"lora.targets": "q,x"}, "lora.targets"),
    ({"lora.targets": "q,q"}, "distinct"),
    ({"lora.dropout": 1.0}, "lora.dropout"),
    ({"lora.alpha": 0}, "lora.alpha"),
    ({"parallel.zero": 3, "parallel.dp": 2}, "zero=3"),
])
def test_bad_lora_configs_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in {**LORA, **overrides}.items()])


def test_moe_mlp_targets_are_rejected():
    with pytest.raises(ConfigError, match="attention only"):
        load_config(preset="tiny-moe", overrides=["lora.r=4"])
    load_config(preset="tiny-moe", overrides=["lora.r=4", "lora.targets=q,k,v,o"])


# -- every layout against one process ------------------------------------------------------------------------

GLOBAL = 8
QLORA = {"lora.quantize_base": "int4", "lora.group_size": 16}
LAYOUTS = {  # name -> (processes, overrides)
    "dp2_zero1": (2, {"parallel.dp": 2, "parallel.zero": 1}),
    "dp2_zero2": (2, {"parallel.dp": 2, "parallel.zero": 2}),
    "tp2": (2, {"parallel.tp": 2}),
    "tp2_sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    # op-level recomputation keeps every other matmul output, the adapters' too: a row-parallel adapter's
    # A x is all-reduced, and the kept partial product must stay partial for the replayed reduction
    "tp2_ops": (2, {"parallel.tp": 2, "train.recompute": "ops"}),
    "pp2_1f1b": (2, {"parallel.pp": 2, "train.grad_accum": 2}),
    "pp2_zb": (2, {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble", "train.grad_accum": 2}),
    "tp2_sp_dp2_zero1": (4, {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.dp": 2,
                             "parallel.zero": 1}),
    "pp2_tp2": (4, {"parallel.pp": 2, "parallel.tp": 2, "train.grad_accum": 2}),
    # QLoRA: each tp rank quantizes its own slice (groups never straddle ranks), against one QLoRA process
    "qlora_tp2_sp": (2, {**QLORA, "parallel.tp": 2, "parallel.sequence_parallel": True}),
    "qlora_pp2_dp2": (4, {**QLORA, "parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 1, "train.grad_accum": 2}),
}


def layout_config(cache, out, base, **overrides) -> dict:
    values = {**BASE, **LORA, "model.num_heads": 8, "model.num_kv_heads": 4, "data.cache_dir": cache,
              "train.out_dir": str(out), "train.init_from": str(base), "train.save_every": 0, **overrides}
    dp, accum = values.get("parallel.dp", 1), values.get("train.grad_accum", 1)
    values["train.micro_batch_size"] = GLOBAL // (dp * accum)
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]).to_dict()


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("lora_layouts")
    base = root / "base"
    values = {**BASE, "model.num_heads": 8, "model.num_kv_heads": 4, "data.cache_dir": data_cache,
              "train.out_dir": str(base), "train.steps": 3, "train.save_every": 0, "train.micro_batch_size": GLOBAL}
    Trainer(load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]), quiet=True).fit()
    Trainer(config_from_dict(layout_config(data_cache, root / "single", base)), quiet=True).fit()
    Trainer(config_from_dict(layout_config(data_cache, root / "single_qlora", base, **QLORA)), quiet=True).fit()
    for nproc in sorted({n for n, _ in LAYOUTS.values()}):
        runs = [{"config": layout_config(data_cache, root / name, base, **overrides)}
                for name, (n, overrides) in LAYOUTS.items() if n == nproc]
        launch_layouts(nproc, runs, root / f"lora_{nproc}.json")
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_matches_one_process(layout_runs, name):
    """Loss within 1e-5, gradient norm within 1e-5 at the first step and 2e-4 after (parity.assert_parity's
    criteria), and every adapter weight within 2e-4 + 1e-4 relative after 10 steps of lr 1e-2."""
    from parity import assert_parity

    run, ref = layout_runs / name, layout_runs / ("single_qlora" if name.startswith("qlora") else "single")
    assert_parity(run, ref, weights=False)
    ours, theirs = (read_adapters(resolve_checkpoint(r), load_model_config(r)) for r in (run, ref))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=2e-4, msg=lambda m: f"{key}: {m}")
    moved = sum((theirs[k] != 0).any().item() for k in theirs if ".lora_B." in k)
    assert moved == sum(".lora_B." in k for k in theirs)  # every B trained: the comparison is not of zeros


def load_model_config(run):
    from fivefold.checkpoint.store import read_config
    return read_config(resolve_checkpoint(run))


# -- QLoRA ---------------------------------------------------------------------------------------------------


def test_qlora_starts_from_the_dequantized_base_and_keeps_int4_codes(tiny_config, base_run):
    from fivefold.finetune.qlora import quantized_weight_bytes
    from fivefold.quant.formats import quantize_int4

    trainer = Trainer(lora_config(tiny_config, base_run, **QLORA), quiet=True)
    _, base = load_model(base_run)
    with torch.no_grad():
        for name, module in base.named_modules():
            if name.startswith("layers.") and name.endswith("_proj"):
                module.weight.copy_(quantize_int4(module.weight, 16).dequantize(torch.float32))
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(trainer.model, ids), logits(base, ids), rtol=1e-5, atol=1e-5)
    codes = {n: b for n, b in trainer.model.named_buffers() if n.endswith((".qweight", ".scales", ".zeros"))}
    linears = [n for n, _ in base.named_parameters() if n.startswith("layers.") and n.endswith("_proj.weight")]
    assert len(codes) == 3 * len(linears) and not any(n in dict(trainer.model.named_parameters()) for n in linears)
    numel = sum(p.numel() for n, p in base.named_parameters() if n in linears)
    assert sum(b.numel() * b.element_size() for b in codes.values()) == quantized_weight_bytes(numel, 16)
    history = trainer.fit(until=3)
    assert all(math.isfinite(r["loss"]) for r in history) and history[-1]["grad_norm"] > 0
    cfg, merged = load_model(trainer.out_dir)  # the dequantized base with the adapters folded in
    torch.testing.assert_close(logits(merged, ids), logits(trainer.model, ids), rtol=1e-5, atol=1e-5)


def test_qlora_trains_as_lora_on_the_dequantized_base(tiny_config, base_run):
    """QLoRA's frozen base is its int4 codes, dequantized for each product, forward and backward: the same
    function as LoRA over a base holding those dequantized values, so the same steps (the layout tests above
    compare QLoRA with QLoRA only, which a wrong input gradient through the codes would pass)."""
    from fivefold.finetune.qlora import dequantized

    qlora = Trainer(lora_config(tiny_config, base_run, **QLORA), quiet=True)
    lora = Trainer(lora_config(tiny_config, base_run), quiet=True)
    with torch.no_grad():
        coded = [(n, m) for n, m in qlora.model.named_modules() if "qweight" in m._buffers]
        assert len(coded) == 7 * qlora.cfg.model.num_layers
        for name, module in coded:
            lora.model.get_submodule(name).weight.copy_(dequantized(module, torch.float32))
    ours, theirs = qlora.fit(until=3), lora.fit(until=3)
    for key, rel in (("loss", 1e-6), ("grad_norm", 1e-5)):
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], rel=rel), key
    adapters = dict(lora.model.named_parameters())
    for name, p in qlora.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, adapters[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_qlora_group_size_must_divide_the_widths():
    with pytest.raises(ConfigError, match="lora.group_size=48"):
        load_config(preset="tiny", overrides=["lora.r=4", "lora.quantize_base=int4", "lora.group_size=48"])
    with pytest.raises(ConfigError, match="set lora.r"):
        load_config(preset="tiny", overrides=["lora.quantize_base=int4"])


def test_adapter_a_is_drawn_like_peft_kaiming_uniform():
    """A (r x in) uniform in +-1/sqrt(in), PEFT's kaiming_uniform_(a=sqrt(5)): its bound is set by the input
    width, not by r (a bound of 1/sqrt(r) would start every adapter several times too loud)."""
    from fivefold.finetune.lora import adapter_value

    a = adapter_value("layers.0.attn.q_proj.lora_A.weight", torch.Size([4, 256]), seed=0)
    peft_like = torch.nn.init.kaiming_uniform_(torch.empty(4, 256), a=math.sqrt(5))
    bound = 1 / math.sqrt(256)
    assert float(peft_like.abs().max()) <= bound and float(a.abs().max()) <= bound
    assert float(a.abs().max()) > 0.95 * bound
    assert torch.equal(adapter_value("layers.0.attn.q_proj.lora_B.weight", torch.Size([64, 4]), seed=0),
                       torch.zeros(64, 4))


def test_adapter_dropout_acts_in_training_only():
    """lora.dropout drops the adapters' input while training; in eval the adapted model is deterministic and
    computes exactly what its merged weights compute."""
    from fivefold.config import LoraConfig
    from fivefold.finetune.lora import apply_lora, merge
    from fivefold.model import build_model
    from fivefold.presets import PRESETS

    lora = LoraConfig(r=4, alpha=8, dropout=0.5)
    model = build_model(PRESETS["tiny"], seed=0)
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = torch.randn(p.shape, generator=g) * 0.1
    ids = torch.randint(0, 512, (2, 16), generator=g)
    model.train()
    assert not torch.equal(logits(model, ids), logits(model, ids))
    model.eval()
    adapted = logits(model, ids)
    assert torch.equal(adapted, logits(model, ids))
    merge(model, lora)
    torch.testing.assert_close(logits(model, ids), adapted, rtol=1e-5, atol=1e-5)
