"""Building a model on the meta device and materialising it with layout-independent init.

Each parameter's initial values depend only on (seed, parameter name): a generator is seeded from
both and draws the *full* tensor on the CPU. A sharded run (TP, EP, PP, ZeRO-3) builds the model on the
meta device, splits it there (fivefold.train.parallelize), and then materialises parameter by parameter
only its local piece of each full tensor, so every layout starts from bit-identical weights (what makes
loss parity with one process exact) while no rank ever holds more than one full parameter at a time.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
import torch._dynamo  # noqa: F401  (see below)
from torch import nn

from fivefold.config import ModelConfig
from fivefold.model.moe import expert_matrix_name, is_stacked_expert
from fivefold.model.transformer import Transformer

# Residual-branch output projections, scaled by 1/sqrt(2 * num_layers) (GPT-2, Radford et al. 2019).
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


# Imported up front on purpose: the first meta-device init op imports torch._dynamo lazily, and a frame of
# that import stays referenced for the life of the process, pinning the whole calling stack (a Trainer
# and every tensor it holds) unless the import has already happened here.


def meta_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
    """The model's structure, without memory: parameters on the meta device, in `dtype`."""
    with torch.device("meta"):
        return Transformer(cfg).to(dtype)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device (no memory), then allocate on `device` and initialise deterministically."""
    model = meta_model(cfg, dtype)
    materialise(model, device, seed, dtype)
    return model


def materialise(model: Transformer, device, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """Give every meta parameter of `model` its initial value (of the full model: no parallel layout)."""
    materialise_parameters(model, lambda name, p: initial_value(name, p.shape, model.cfg, seed), device, dtype)


@torch.no_grad()
def materialise_parameters(model: Transformer, value_of: Callable[[str, torch.Tensor], torch.Tensor], device,
                           dtype: torch.dtype, keep: Callable[[int, torch.Tensor], None] | None = None) -> None:
    """Replace each meta parameter, one at a time, by `value_of(name, meta_param)` (fp32) cast to
    `dtype` on `device`. The Parameter objects stay the same (tied weights stay tied). `keep(i, value)`
    sees each fp32 value before it is dropped, e.g. to keep master weights: at most one value is
    alive here at any time."""
    for i, (name, param) in enumerate(model.named_parameters()):
        value = value_of(name, param).to(device).contiguous()  # a value source may hand out strided views
        give_memory(param, value.to(dtype))
        if keep is not None:
            keep(i, value)
        del value
    model.reset_buffers(device)


def give_memory(param: nn.Parameter, data: torch.Tensor) -> None:
    """Make the meta Parameter `param` hold `data`, keeping the Python object (modules, tied weights,
    optimizers and hooks keep referring to it) and the gradient hooks already registered on it."""
    hooks = dict(param._backward_hooks or {})
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    param._backward_hooks = None  # the swap left its hook dict registered with the old (meta) tensor only
    if param.requires_grad:  # a frozen parameter (LoRA's base) keeps no gradient hooks
        for hook in hooks.values():
            param.register_hook(hook)


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (a pure function of seed, name and shape)."""
    if is_stacked_expert(name):
        return torch.stack([initial_expert_matrix(name, e, shape, cfg, seed) for e in range(shape[0])])
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(_RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * cfg.num_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def initial_expert_matrix(name: str, expert: int, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Expert `expert`'s full matrix of the stacked expert weight `name` (global shape `shape`), drawn
    from its own name: a rank holding some experts draws only theirs, one at a time."""
    return initial_value(expert_matrix_name(name, expert), shape[1:], cfg, seed)
