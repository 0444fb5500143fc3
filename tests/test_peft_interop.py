"""LoRA adapters in PEFT's format: a fivefold LoRA run on an imported Hugging Face model, exported with
`fivefold export-hf`, loads with the real `peft` library onto the transformers model and gives fivefold's
logits; the adapter loads back into fivefold (lora.init_from); --merge writes the merged model."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from fivefold.cli import main  # noqa: E402
from fivefold.config import ConfigError
from fivefold.config_load import load_config  # noqa: E402
from fivefold.errors import CheckpointError  # noqa: E402
from fivefold.finetune.peft import read_adapter_config  # noqa: E402
from fivefold.interop.hf import config_from_hf  # noqa: E402
from fivefold.weights import load_model  # noqa: E402
from fivefold.train.trainer import Trainer  # noqa: E402
from parity import BASE  # noqa: E402

LORA = {"lora.r": 4, "lora.alpha": 16, "lora.targets": "q,k,v,o,gate,up,down"}


def lora_config(cache, out, base, **overrides):
    values = {**BASE, **LORA, "data.cache_dir": cache, "train.out_dir": str(out), "train.init_from": str(base),
              "train.micro_batch_size": 8, "train.steps": 3, "train.save_every": 0, "train.lr": 3e-2, **overrides}
    cfg = load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])
    cfg.model = config_from_hf(json.loads((base / "config.json").read_text()))
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """(root, trainer): a LoRA run of 3 steps on a random Llama saved by transformers."""
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(root / "base", safe_serialization=True)
    trainer = Trainer(lora_config(data_cache, root / "run", root / "base"), quiet=True)
    trainer.fit()
    return root, trainer


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def test_peft_loads_the_adapter_with_fivefold_logits(trained):
    root, trainer = trained
    assert main(["export-hf", "--checkpoint", str(root / "run"), "--out", str(root / "adapter")]) == 0
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    with torch.no_grad():
        ours = trainer.model(IDS).float()
    untouched = AutoModelForCausalLM.from_pretrained(root / "base")
    assert (hf_logits(untouched, IDS) - ours).abs().max() > 1e-3  # the adapter changes the logits: not a no-op
    torch.testing.assert_close(hf_logits(adapted, IDS), ours, rtol=1e-4, atol=1e-4)


def test_peft_adapter_loads_back_and_merged_export_matches(trained, data_cache, tmp_path):
    root, trainer = trained
    if not (root / "adapter").is_dir():
        main(["export-hf", "--checkpoint", str(root / "run"), "--out", str(root / "adapter")])
    assert read_adapter_config(root / "adapter").r == 4
    back = Trainer(lora_config(data_cache, tmp_path / "back", root / "base",
                               **{"lora.init_from": str(root / "adapter")}), quiet=True)
    with torch.no_grad():
        ours, again = trainer.model(IDS).float(), back.model(IDS).float()
    torch.testing.assert_close(again, ours, rtol=1e-6, atol=1e-6)

    assert main(["export-hf", "--checkpoint", str(root / "run"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(hf_logits(merged, IDS), ours, rtol=1e-4, atol=1e-4)
    _, loaded = load_model(root / "run")  # fivefold's own merged load
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).float(), ours, rtol=1e-4, atol=1e-4)


def test_mismatched_or_unsupported_adapters_are_refused(trained, data_cache, tmp_path):
    root, _ = trained
    if not (root / "adapter").is_dir():
        main(["export-hf", "--checkpoint", str(root / "run"), "--out", str(root / "adapter")])
    with pytest.raises(ConfigError, match="set lora.r=4"):
        Trainer(lora_config(data_cache, tmp_path / "a", root / "base",
                            **{"lora.r": 8, "lora.init_from": str(root / "adapter")}), quiet=True)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_adapter_config(dora)
