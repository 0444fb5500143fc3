"""LoRA adapters in Hugging Face PEFT's format: a directory with `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(transformers_model, DIR)` loads onto the
Hugging Face export of the same base (fivefold export-hf).

Tensor names are the base's Hugging Face names (fivefold.interop.hf) under PEFT's `base_model.model.` prefix,
with `.lora_A.weight` (r x in) and `.lora_B.weight` (out x r), in fp32: e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Only what fivefold computes is written or
accepted: plain LoRA (no DoRA, no rsLoRA scaling, no bias training, one rank and alpha for every module)
on the Llama family's linear layers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError, LoraConfig
from fivefold.errors import CheckpointError
from fivefold.finetune.lora import MODULES, adapter_shapes
from fivefold.interop.hf import hf_name

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TARGET_OF = {module: target for target, module in MODULES.items()}


def _check_family(cfg: Config) -> None:
    if cfg.model.position == "learned":
        raise ConfigError("PEFT adapters are written for the Llama family (RoPE models); this model has GPT-2's "
                          "layout (learned positions), whose fused attention PEFT names differently")


def hf_adapter_name(name: str) -> str:
    """fivefold adapter name -> PEFT's: layers.0.attn.q_proj.lora_A.weight ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    module, kind = name.split(".lora_")
    return f"{PREFIX}{hf_name(module + '.weight').removesuffix('.weight')}.lora_{kind}"


def save_adapter(adapters: dict[str, torch.Tensor], cfg: Config, out_dir: str | Path, base: str = "") -> Path:
    """Write `adapters` (fivefold names, whole tensors: fivefold.finetune.lora.read_adapters) as a PEFT
    adapter directory; `base`: the base model's name or path, recorded for PEFT's loaders."""
    from safetensors.torch import save_file

    _check_family(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_adapter_name(n): t.detach().float().contiguous() for n, t in sorted(adapters.items())}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.r, "lora_alpha": cfg.lora.alpha,
              "lora_dropout": cfg.lora.dropout, "target_modules": sorted(MODULES[t] for t in cfg.lora.target_list),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": base, "rank_pattern": {}, "alpha_pattern": {}}
    tmp = out / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)  # the weights first: a config never points at missing weights
    tmp = out / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out / CONFIG_FILE)
    return out


def read_adapter_config(directory: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory, refusing what fivefold does not compute."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}; expected a PEFT LoRA adapter directory")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if values.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {values.get('peft_type')!r}; fivefold loads LORA adapters")
    unsupported = [key for key, off in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False))
                   if values.get(key, off) != off]
    unsupported += [key for key in ("rank_pattern", "alpha_pattern", "modules_to_save") if values.get(key)]
    if values.get("bias", "none") != "none":
        unsupported.append(f"bias={values['bias']}")
    if unsupported:
        raise CheckpointError(f"{path}: {', '.join(unsupported)} is not supported (fivefold computes plain LoRA "
                              f"with one rank and alpha for every module)")
    modules = values.get("target_modules") or []
    if isinstance(modules, str) or any(m not in _TARGET_OF for m in modules):
        raise CheckpointError(f"{path}: target_modules {modules!r}; fivefold adapts any of "
                              f"{', '.join(_TARGET_OF)}")
    targets = [t for t in MODULES if MODULES[t] in modules]
    return LoraConfig(r=int(values["r"]), alpha=float(values["lora_alpha"]),
                      dropout=float(values.get("lora_dropout", 0.0)), targets=",".join(targets))


def read_adapter(directory: str | Path, cfg: Config) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors under fivefold's names, checked against `cfg` (its lora section must be the
    adapter's: rank, alpha and targets) and the model's shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _check_family(cfg)
    theirs = read_adapter_config(directory)
    ours = cfg.lora
    if (theirs.r, theirs.alpha, theirs.target_list) != (ours.r, ours.alpha, ours.target_list):
        raise ConfigError(f"the adapter in {directory} has r={theirs.r}, alpha={theirs.alpha:g}, targets="
                          f"{theirs.targets}; set lora.r={theirs.r} lora.alpha={theirs.alpha:g} "
                          f"lora.targets={theirs.targets}")
    try:
        tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{Path(directory) / WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    shapes = adapter_shapes(cfg.model, ours)
    by_hf = {hf_adapter_name(n): n for n in shapes}
    # PEFT writes no adapter name into the file, but some tools keep ".default" in it.
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}
    missing, unexpected = sorted(set(by_hf) - set(tensors)), sorted(set(tensors) - set(by_hf))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: the adapter does not fit this model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    out = {}
    for hf, name in by_hf.items():
        if tuple(tensors[hf].shape) != shapes[name]:
            raise CheckpointError(f"{directory}: {hf} has shape {tuple(tensors[hf].shape)}, this model needs "
                                  f"{shapes[name]}")
        out[name] = tensors[hf].float()
    return out
