"""Building a model on the meta device and materialising it with layout-independent init.

Each parameter's initial values depend only on (seed, parameter name): a generator is seeded from
both and draws the *full* tensor on the CPU. A sharded run (TP, FSDP, PP) slices that full tensor to
its local piece, so every layout starts from bit-identical weights, which is what makes loss parity
between parallel and single-process runs exact.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from fivefold.config import ModelConfig
from fivefold.model.transformer import Transformer

# Residual-branch output projections, scaled by 1/sqrt(2 * num_layers) (GPT-2, Radford et al. 2019).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device (no memory), then allocate on `device` and initialise deterministically."""
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize(model, device, seed, dtype)
    return model


def materialize(model: Transformer, device, seed: int, dtype: torch.dtype = torch.float32) -> None:
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    init_parameters(model, seed)
    model.to(dtype)
    model.reset_buffers()  # keep the rope frequencies in fp32 whatever the parameter dtype


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (a pure function of seed, name and shape)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * cfg.num_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    cfg = model.cfg
    for name, param in model.named_parameters():  # tied weights appear once, under their first name
        param.copy_(initial_value(name, param.shape, cfg, seed))
