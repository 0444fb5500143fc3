"""Loading a model to serve: from a Hugging Face directory (or a fivefold export) or a fivefold run or
checkpoint (written under any training layout), with its tokenizer and chat template.

The model is built on the meta device and each parameter is materialised from the files one tensor
at a time (safetensors slices for Hugging Face files, DCP reads for fivefold checkpoints): the process
never holds more than the weights it serves plus one tensor, also when it is one tensor-parallel shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError, ModelConfig, ParallelConfig
from fivefold.model import Transformer, meta_model
from fivefold.model.init import materialize_parameters
from fivefold.serve.tensor_parallel import TensorParallelGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None  # tokenizers.Tokenizer
    directory: Path  # where the weights and tokenizer files are
    chat_template: str | None = None
    tp: TensorParallelGroup | None = None


def is_hf_directory(src: Path) -> bool:
    """A Hugging Face model directory; a fivefold checkpoint has a config.json too, beside its state/, and a
    quantized model (fivefold quantize) beside its quantization.json."""
    from fivefold.quant.checkpoint import is_quantized_dir

    return (src / "config.json").is_file() and not (src / "state").is_dir() and not is_quantized_dir(src)


def model_directory(source: str | Path) -> Path:
    """The directory holding the weights: an HF directory itself, or a run's latest checkpoint."""
    from fivefold.quant.checkpoint import is_quantized_dir

    src = Path(source)
    if is_hf_directory(src) or is_quantized_dir(src):
        return src
    from fivefold.train.checkpoint import resolve_checkpoint
    return resolve_checkpoint(src)


def model_config_of(directory: Path) -> ModelConfig:
    """The ModelConfig of an HF directory or a fivefold checkpoint, read without any weights."""
    if is_hf_directory(directory):
        from fivefold.interop.hf import config_from_hf, read_hf_config
        return config_from_hf(read_hf_config(directory))
    from fivefold.train.checkpoint import read_config
    return read_config(directory).model


def load_model_for_serving(source: str | Path, tokenizer: str | Path | None = None, dtype: str = "float32",
                           device: str | torch.device = "cpu", tp: int = 1) -> LoadedModel:
    """The model (this rank's shard when tp > 1: the process group is started here, after the layout is
    validated), its tokenizer.json and, from tokenizer_config.json, its chat template."""
    from fivefold.parallel.placement import record
    from fivefold.train.checkpoint import Piece, read_config, read_state

    from fivefold.quant.checkpoint import is_quantized_dir, load_quantized

    directory = model_directory(source)
    device = torch.device(device)
    if is_quantized_dir(directory):  # int8 / int4 / GPTQ codes, computed by QuantLinear (fivefold.quant)
        if tp > 1:
            raise ConfigError(f"{directory} is a quantized model: serve it with tp=1 (its codes are not split "
                              f"into tensor-parallel shards)")
        _, model = load_quantized(directory, device, DTYPES[dtype])
        tok, template = tokenizer_and_template(directory, tokenizer)
        return LoadedModel(model, tok, directory, template, None)
    cfg = Config(model=model_config_of(directory), parallel=ParallelConfig(tp=tp))
    model = meta_model(cfg.model, torch.float32)
    axes, group = {}, None
    if tp > 1:
        from fivefold.parallel.mesh import init_mesh
        from fivefold.parallel.tensor_parallel import apply_tensor_parallel

        mesh = init_mesh(cfg, device)  # rejects e.g. heads not divisible by tp before any group starts
        axes = apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=False)
        group = TensorParallelGroup(mesh.tp_group, mesh.tp_rank, mesh.tp_size)
    placements = record(model, axes, set(), group.rank if group else 0, tp)
    if is_hf_directory(directory):
        from fivefold.interop.hf import HFWeights
        weights = HFWeights(directory, cfg.model)  # a tensor-parallel rank reads only its slices
        materialize_parameters(model, lambda name, p: weights(name, placements[name]), device, torch.float32)
    elif read_config(directory).lora.r:  # a LoRA run: its base with the adapters folded in, slice by slice
        from fivefold.finetune.lora import merged_values
        values = merged_values(directory, read_config(directory))
        materialize_parameters(model, lambda name, p: values(name, placements[name]), device, torch.float32)
    else:
        materialize_parameters(model, lambda name, p: torch.empty(placements[name].local_shape), device,
                               torch.float32)
        with torch.no_grad():  # straight into this rank's slices, whatever layout wrote the checkpoint
            read_state(directory, {f"model.{name}": Piece(p, placements[name].global_shape, placements[name].offsets)
                                   for name, p in model.named_parameters()})
    model = model.to(DTYPES[dtype])
    model.reset_buffers(device)
    tok, template = tokenizer_and_template(directory, tokenizer)
    return LoadedModel(model.eval(), tok, directory, template, group)


def tokenizer_and_template(directory: Path, tokenizer: str | Path | None = None):
    """(tokenizers.Tokenizer or None, chat template or None) of a model directory; `tokenizer`: another
    tokenizer.json to use."""
    from fivefold.data.tokenizer import load_tokenizer

    path = Path(tokenizer) if tokenizer else directory / "tokenizer.json"
    tok = load_tokenizer(path) if tokenizer or path.is_file() else None
    template = None
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        from fivefold.train.checkpoint import read_json
        template = read_json(config_path).get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return tok, template
