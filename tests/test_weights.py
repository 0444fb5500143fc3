"""Every source of weights loads through fivefold.weights to the tensors another reader gives: a Hugging Face
directory (transformers' own model, and import-hf), a checkpoint written sharded under ZeRO-3 with tensor
parallelism (the one-process run from the same seed and batch, at parity; and its own slices read one by
one), a LoRA run (the live adapted model, folded by lora.merge), a PEFT adapter directory (the adapters it
was written from), and a GPTQ directory (the in-memory quantized model it was saved from)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from fivefold.checkpoint.store import resolve_checkpoint  # noqa: E402
from fivefold.config import ConfigError  # noqa: E402
from fivefold.config_load import load_config  # noqa: E402
from fivefold.finetune.lora import merge, read_adapters  # noqa: E402
from fivefold.finetune.peft import save_adapter  # noqa: E402
from fivefold.interop.hf import import_hf  # noqa: E402
from fivefold.model import build_model  # noqa: E402
from fivefold.parallel.placement import Placement  # noqa: E402
from fivefold.quant.directory import save_quantized  # noqa: E402
from fivefold.quant.gptq import quantize_model  # noqa: E402
from fivefold.quant.linear import swap_linears  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402
from fivefold.weights import adapter_weights, load_model, weight_source  # noqa: E402
from parity import BASE, assert_weights_match, final_weights, gradient_rms, launch_layouts  # noqa: E402

IDS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(5))
TP_AXES = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_slices_match(source, whole: dict[str, torch.Tensor]) -> None:
    """The value source of `source` under a tp=2 split hands each rank exactly its rows (or columns) of the
    whole tensor, one parameter at a time."""
    values = source.values()
    for name, full in whole.items():
        axis = TP_AXES.get(name.split(".")[-2])
        if axis is None:
            assert torch.equal(values(name, Placement(tuple(full.shape))), full), name
            continue
        parts = [values(name, Placement(tuple(full.shape), axis, rank, 2)) for rank in range(2)]
        assert torch.equal(torch.cat(parts, dim=axis), full), name


def config(cache, out, **overrides):
    values = {**BASE, "data.cache_dir": cache, "train.out_dir": str(out), "train.steps": 3, "train.save_every": 0,
              "train.micro_batch_size": 8, **overrides}
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])


def test_a_hugging_face_directory(tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # norms off their ones, so a mis-mapped one shows
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "llama", safe_serialization=True)
    source = weight_source(tmp_path / "llama")
    assert source.kind == "hf" and source.config.model.hidden_size == 64
    model = source.load()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).float(), hf(IDS).logits.float(), rtol=1e-5, atol=1e-5)
    _, imported = import_hf(tmp_path / "llama")
    whole = params(model)
    assert all(torch.equal(whole[n], p) for n, p in params(imported).items())
    assert_slices_match(source, whole)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One process, and dp=2 x tp=2 with ZeRO-3 (each rank writes its rows of its shards), same seed and
    global batch; then a LoRA run on the one-process model."""
    root = tmp_path_factory.mktemp("weights")
    Trainer(config(data_cache, root / "single"), quiet=True).fit()
    sharded = config(data_cache, root / "zero3_tp2", **{"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3,
                                                        "train.micro_batch_size": 4})
    launch_layouts(4, [{"config": sharded.to_dict()}], root / "zero3_tp2.json")
    lora = Trainer(config(data_cache, root / "lora", **{"lora.r": 4, "lora.alpha": 8, "train.lr": 3e-2,
                                                       "train.init_from": str(root / "single")}), quiet=True)
    lora.fit()
    return root, lora


def test_a_checkpoint_written_sharded_under_zero3_and_tp(runs):
    root, _ = runs
    source = weight_source(root / "zero3_tp2")
    assert source.kind == "checkpoint" and source.config.parallel.zero == 3 and source.config.parallel.tp == 2
    whole = params(source.load())
    assert_weights_match(whole, final_weights(root / "single"), gradient_rms(root / "single"))
    assert_slices_match(source, whole)  # each rank's slices, read alone, are the rows of the collective read


def test_a_lora_run_loads_as_its_base_with_the_adapters_folded_in(runs):
    root, trainer = runs
    source = weight_source(root / "lora")
    assert source.kind == "lora"
    # A copy of the live adapted model, folded by lora.merge: W += (alpha / r) B A, adapters removed.
    adapted = copy.deepcopy(trainer.model)
    merge(adapted, trainer.cfg.lora)
    reference = params(adapted)
    assert set(reference) == {n for n, _ in trainer.model.named_parameters() if ".lora_" not in n}
    loaded = params(source.load())
    assert loaded.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(loaded[name], reference[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert_slices_match(source, loaded)
    cfg, model = load_model(root / "lora")
    assert cfg.lora.r == 4 and all(torch.equal(loaded[n], p) for n, p in params(model).items())


def test_adapters_from_a_peft_directory_and_from_a_lora_run(runs, tmp_path):
    root, trainer = runs
    ckpt = resolve_checkpoint(root / "lora")
    adapters = read_adapters(ckpt, trainer.cfg)
    assert adapters and any(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_B." in n)
    save_adapter(adapters, trainer.cfg, tmp_path / "peft", base=str(root / "single"))
    lora, tensors = adapter_weights(tmp_path / "peft", trainer.cfg.model, "the adapter")
    assert (lora.r, lora.alpha, lora.target_list) == (4, 8, trainer.cfg.lora.target_list)
    assert tensors.keys() == adapters.keys() and all(torch.equal(tensors[n], t) for n, t in adapters.items())
    lora, tensors = adapter_weights(root / "lora", trainer.cfg.model, "the adapter")
    assert lora.r == 4 and all(torch.equal(tensors[n], t) for n, t in adapters.items())
    with pytest.raises(ConfigError, match="is not a LoRA run"):
        adapter_weights(root / "single", trainer.cfg.model, "the adapter")


def test_a_gptq_directory(tmp_path):
    cfg = load_config(preset="tiny")
    model = build_model(cfg.model, seed=3).eval()
    calibration = [torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(14 + i)) for i in range(3)]
    qweights = quantize_model(model, "gptq", 16, calibration)
    save_quantized(tmp_path / "q", cfg, model, qweights, {"windows": 3})
    source = weight_source(tmp_path / "q")
    assert source.kind == "quantized" and source.config.model == cfg.model
    loaded = source.load()
    with torch.no_grad():
        swap_linears(model, qweights)
        assert torch.equal(loaded(IDS), model(IDS))
    with pytest.raises(ConfigError, match="quantized model"):
        source.values()  # codes, not values to start a run from
