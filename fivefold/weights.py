"""Where a model's weights come from: one answer, `weight_source(path)`, for training's train.init_from,
serving, export and quantize.

A *value source* is `(name, placement) -> this rank's fp32 part of parameter name` (its tensor-parallel
slice, its experts' rows): materialisation calls it one parameter at a time, so no rank ever holds more
than what it keeps. Each kind of source gives one:

    seeded init               initial_values(cfg): from (train.seed, name), the same under every layout
    Hugging Face directory    interop.hf.HFWeights: safetensors, sliced as they are read
    fivefold checkpoint       checkpoint.pieces.CheckpointWeights: DCP reads of this rank's rows, whatever
                              layout wrote them
    LoRA run (merged)         its base (the run's own train.init_from, else its seed) plus (alpha / r) B A
    quantized directory       (fivefold quantize) int8 / int4 codes, loaded whole as QuantLinears (no fp32
                              value to slice: `load` only)
    PEFT adapter directory    LoRA adapters, not a model: `adapter_weights`
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fivefold.checkpoint.kinds import is_hf_directory, is_quantized_dir, model_directory
from fivefold.checkpoint.pieces import CheckpointWeights, Piece, read_state
from fivefold.checkpoint.store import read_config
from fivefold.config import Config, ConfigError, LoraConfig, ModelConfig
from fivefold.finetune.lora import MODULES, adapter_value, is_adapter, read_adapters, targets
from fivefold.finetune.peft import read_adapter, read_adapter_config
from fivefold.interop.hf import HFWeights, check_same_shapes, config_from_hf, read_hf_config
from fivefold.model import Transformer, initial_expert_matrix, initial_value, materialise_parameters, meta_model
from fivefold.model.moe import is_stacked_expert
from fivefold.parallel.placement import Placement
from fivefold.quant.directory import load_quantized
from fivefold.quant.formats import quantize_int4

ValueSource = Callable[[str, Placement], torch.Tensor]


@dataclass
class WeightSource:
    """A model's weights as found at a path: what kind, where exactly, and the config they were saved with
    (a Hugging Face directory's is its config.json's model, with defaults elsewhere)."""
    kind: str  # "hf", "checkpoint", "lora" (a LoRA run's checkpoint: merged on reading), "quantized"
    directory: Path
    config: Config

    def values(self) -> ValueSource:
        if self.kind == "hf":
            return HFWeights(self.directory, self.config.model)
        if self.kind == "lora":
            return merged_values(self.directory, self.config)
        if self.kind == "checkpoint":
            return CheckpointWeights(self.directory)
        raise ConfigError(f"{self.directory} is a quantized model: its weights are int8 / int4 codes, not values "
                          f"to start from or to split; give the full-precision model it was made from")

    def materialise(self, model: torch.nn.Module, placements: dict[str, Placement],
                    device: torch.device) -> None:
        """Give a meta `model` (sharded as `placements` say) this source's values on `device`, in fp32."""
        if self.kind == "checkpoint":  # one collective read, straight into each rank's slices
            materialise_parameters(model, lambda name, p: torch.empty(placements[name].local_shape), device,
                                   torch.float32)
            with torch.no_grad():
                read_state(self.directory, {f"model.{name}": Piece(p, placements[name].global_shape,
                                                                   placements[name].offsets)
                                            for name, p in model.named_parameters()})
            return
        values = self.values()
        materialise_parameters(model, lambda name, p: values(name, placements[name]), device, torch.float32)

    def load(self, device="cpu", dtype: torch.dtype = torch.float32) -> Transformer:
        """The whole model on `device` in `dtype` (quantized: its QuantLinears computing in `dtype`)."""
        if self.kind == "quantized":
            return load_quantized(self.directory, device, dtype)[1]
        model = meta_model(self.config.model, torch.float32)
        placements = {name: Placement(tuple(p.shape)) for name, p in model.named_parameters()}
        self.materialise(model, placements, torch.device(device))
        model.to(dtype)
        model.reset_buffers()
        return model


def weight_source(path: str | Path) -> WeightSource:
    """The weights at `path`: a Hugging Face directory, a fivefold checkpoint, run or checkpoints root (its
    newest intact checkpoint; a LoRA run's is its base with the adapters folded in), or a quantized
    directory."""
    directory = model_directory(path)
    if is_hf_directory(directory):
        return WeightSource("hf", directory, Config(model=config_from_hf(read_hf_config(directory))))
    cfg = read_config(directory)
    if is_quantized_dir(directory):
        return WeightSource("quantized", directory, cfg)
    return WeightSource("lora" if cfg.lora.r else "checkpoint", directory, cfg)


def model_config_of(path: str | Path) -> ModelConfig:
    """The model shape of the weights at `path`, read without any weights."""
    return weight_source(path).config.model


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[Config, Transformer]:
    """(config, whole model) of any source `weight_source` reads."""
    source = weight_source(path)
    return source.config, source.load(device, dtype)


# -- a training run's start -------------------------------------------------------------------------------


def initial_values(cfg: Config) -> ValueSource:
    """The layout-independent initialisation: each parameter's full value from (seed, name), sliced."""
    def value(name: str, placement: Placement) -> torch.Tensor:
        shape = torch.Size(placement.global_shape)
        if not is_stacked_expert(name):
            return placement.local(initial_value(name, shape, cfg.model, cfg.train.seed))
        out, one = torch.empty(placement.local_shape), placement.per_expert()
        for row, e in enumerate(placement.experts):  # this rank's experts, one full matrix at a time
            out[row] = one.local(initial_expert_matrix(name, e, shape, cfg.model, cfg.train.seed))
        return out
    return value


def init_from_values(cfg: Config) -> ValueSource | None:
    """The values train.init_from gives (each rank reading only its parts); None without train.init_from."""
    init = cfg.train.init_from
    if not init:
        return None
    if not Path(init).exists():
        raise ConfigError(f"train.init_from={init!r} does not exist; give a Hugging Face model directory or a "
                          f"fivefold run or checkpoint directory")
    source = weight_source(init)
    if source.kind == "lora":
        raise ConfigError(f"train.init_from={init!r} is a LoRA run: its checkpoints hold adapters, not the model; "
                          f"merge them first (fivefold export-hf {init} --merge --out DIR) and start from DIR")
    check_same_shapes(cfg.model, source.config.model, f"train.init_from={str(source.directory)!r}")
    return source.values()


def with_adapters(values: ValueSource, cfg: Config) -> ValueSource:
    """`values` for the base's parameters; LoRA's adapters from lora.init_from (a PEFT adapter directory) or
    their own seeded init, whatever the base's source."""
    if cfg.lora.init_from:
        loaded = read_adapter(cfg.lora.init_from, cfg)

        def adapter(name, shape):
            return loaded[name]
    else:
        def adapter(name, shape):
            return adapter_value(name, shape, cfg.train.seed)
    return lambda name, placement: placement.local(adapter(name, torch.Size(placement.global_shape))) \
        if is_adapter(name) else values(name, placement)


def take_source_shape(cfg: Config) -> Config:
    """With train.init_from and no model settings of its own (the default model: no preset, no model.*
    key), a run takes its source's model shape, so `--set train.init_from=RUN` needs nothing else."""
    if cfg.train.init_from and cfg.model == ModelConfig() and Path(cfg.train.init_from).exists():
        cfg.model = model_config_of(cfg.train.init_from)
    return cfg


# -- LoRA ----------------------------------------------------------------------------------------------------


def merged_values(ckpt: Path, cfg: Config) -> ValueSource:
    """A LoRA run's model with its adapters folded in: each base weight from where the run's base came from
    (train.init_from, else the seeded init) plus its slice of (alpha / r) B A. A plain model computing what
    the adapted one did, for serving and export."""
    base = init_from_values(cfg) or initial_values(cfg)
    adapters = read_adapters(ckpt, cfg)
    quantized = {f"{n}.weight" for n, _ in targets(meta_model(cfg.model), LoraConfig(r=1, targets=",".join(MODULES)))}

    def value(name: str, placement: Placement) -> torch.Tensor:
        v = base(name, placement)
        module = name.removesuffix(".weight")
        if cfg.lora.quantize_base != "none" and name in quantized:  # QLoRA trained on the dequantized base
            v = quantize_int4(v, cfg.lora.group_size).dequantize(torch.float32)
        if f"{module}.lora_A.weight" in adapters:
            delta = adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"] * cfg.lora.scaling
            v = v + placement.local(delta)
        return v
    return value


def adapter_weights(source: str | Path, model_cfg: ModelConfig, what: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(LoRA settings, whole fp32 adapter tensors by parameter name) of a PEFT adapter directory or a fivefold
    LoRA run / checkpoint, checked against `model_cfg` (the base they will adapt); `what` names it in errors."""
    source = Path(source)
    if (source / "adapter_config.json").is_file():
        lora = read_adapter_config(source)
        return lora, read_adapter(source, Config(model=model_cfg, lora=lora))
    found = weight_source(source)
    if found.kind != "lora":
        raise ConfigError(f"{what}: {source} is not a LoRA run (lora.r=0); give a LoRA run, its checkpoint, or a "
                          f"PEFT adapter directory")
    check_same_shapes(model_cfg, found.config.model, f"{what} ({source})")
    return found.config.lora, read_adapters(found.directory, found.config)
