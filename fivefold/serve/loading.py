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

from fivefold.config import Config, ConfigError, ParallelConfig
from fivefold.data.chat import tokenizer_and_template
from fivefold.model import Transformer, meta_model
from fivefold.parallel.mesh import init_mesh
from fivefold.parallel.placement import record
from fivefold.parallel.tensor_parallel import apply_tensor_parallel
from fivefold.serve.sharded import TensorParallelGroup
from fivefold.weights import weight_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None  # tokenizers.Tokenizer
    directory: Path  # where the weights and tokenizer files are
    chat_template: str | None = None
    tp: TensorParallelGroup | None = None


def load_model_for_serving(source: str | Path, tokenizer: str | Path | None = None, dtype: str = "float32",
                           device: str | torch.device = "cpu", tp: int = 1) -> LoadedModel:
    """The model (this rank's shard when tp > 1: the process group is started here, after the layout is
    checked), its tokenizer.json and, from tokenizer_config.json, its chat template."""
    found = weight_source(source)
    device = torch.device(device)
    tok, template = tokenizer_and_template(found.directory, tokenizer)
    if found.kind == "quantized":  # int8 / int4 / GPTQ codes, computed by QuantLinear (fivefold.quant)
        if tp > 1:
            raise ConfigError(f"{found.directory} is a quantized model: serve it with tp=1 (its codes are not "
                              f"split into tensor-parallel shards)")
        return LoadedModel(found.load(device, DTYPES[dtype]), tok, found.directory, template, None)
    cfg = Config(model=found.config.model, parallel=ParallelConfig(tp=tp))
    model = meta_model(cfg.model, torch.float32)
    placements, group = record(model, {}, set()), None
    if tp > 1:
        mesh = init_mesh(cfg, device)  # rejects e.g. heads not divisible by tp before any group starts
        axes = apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=False)
        placements = record(model, axes, set(), mesh.tp_rank, tp)
        group = TensorParallelGroup(mesh.tp_group, mesh.tp_rank, mesh.tp_size, placements)
    # Each rank reads only its slices, whatever layout wrote a checkpoint (a LoRA run: merged as read).
    found.materialise(model, placements, device)
    model = model.to(DTYPES[dtype])
    model.reset_buffers(device)
    return LoadedModel(model.eval(), tok, found.directory, template, group)
