"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") applied from outside the
model, after its parallel layout: every targeted linear W gets y = W x + (alpha / r) B A dropout(x), and
everything else is frozen (no gradient, no optimizer state).

The adapters are child modules of the linear they adapt, named `lora_A` (r x in) and `lora_B` (out x r),
so a parameter is `layers.3.attn.q_proj.lora_A.weight`: the base's names (checkpoints, the name-seeded init,
Hugging Face import) do not change, and the names map one-to-one onto PEFT's (fivefold.finetune.peft). A is
drawn from (seed, name) like every parameter, uniform in +-1/sqrt(in) (PEFT's default, Kaiming-uniform with
a = sqrt(5)); B starts at zero, so step 0 is the base model exactly.

Under tensor parallelism the adapter follows its base layer's split (Megatron's rule, one level down):
    column-parallel W (q, k, v, gate, up: output rows split; input whole on every rank)
        A whole; B split by rows. Each rank's B^T dy is a partial sum of A's output gradient, so A's
        gradient is summed over the tp group; the input gradient is summed by the layer's own f / gather.
    row-parallel W (o, down: input columns split; outputs summed across ranks)
        A split by columns, so A x is a partial sum: reduced over the group (all-reduce, or reduce-scatter
        along the sequence under SP: r numbers per token, not hidden) before B, which is whole. Under SP
        each rank's B sees its part of the sequence, so B's gradient is summed over the group.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.checkpoint.pieces import read_state
from fivefold.config import LoraConfig, ModelConfig
from fivefold.model.init import meta_model, param_seed
from fivefold.parallel.collectives import ReduceFromTP, ReduceScatterSequence, all_reduce_hook
from fivefold.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# lora.targets -> the linear's attribute name in the model (GELU MLPs call fc "up" and proj "down").
MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial fp32 value of adapter parameter `name` (full shape): A uniform in +-1/sqrt(fan_in) from
    (seed, name), B zero."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def targets(model: nn.Module, lora: LoraConfig) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear `lora.targets` names, in the model's order."""
    wanted = {MODULES[t] for t in lora.target_list}
    out = []
    for prefix, block in ((f"layers.{i}", b) for i, b in enumerate(model.layers)):
        for part in ("attn", "mlp"):
            parent = getattr(block, part, None)
            for attr in sorted(wanted, key=list(MODULES.values()).index):
                module = getattr(parent, attr, None) if parent is not None else None
                if module is not None:
                    out.append((f"{prefix}.{part}.{attr}", module))
    return out


def linear_shape(module: nn.Module, tp_size: int) -> tuple[int, int]:
    """(out, in) of a linear's full weight, whatever its tensor-parallel kind."""
    out_f, in_f = module.weight.shape
    if isinstance(module, ColumnParallelLinear):
        out_f *= tp_size
    elif isinstance(module, RowParallelLinear):
        in_f *= tp_size
    return out_f, in_f


class _Adapter:
    """The forward hook adding (alpha / r) B A dropout(x) to a linear's output; `reduce(h, module)`: how a
    row-parallel layer's partial A x is summed over the tensor-parallel group (None: A x is complete)."""

    def __init__(self, scaling: float, dropout: float, reduce=None):
        self.scaling, self.dropout, self.reduce = scaling, dropout, reduce

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if self.dropout:
            x = F.dropout(x, self.dropout, module.training)
        h = module.lora_A(x)
        if self.reduce is not None:
            h = self.reduce(h, module)
        return output + module.lora_B(h) * self.scaling


def apply_lora(model: nn.Module, lora: LoraConfig, tp_group=None, sequence_parallel: bool = False) -> dict[str, int]:
    """Freeze every parameter of `model` (on the meta device, possibly tensor-parallel already) and add
    adapters to the targeted linears. Returns {adapter parameter name: axis split across the tp group}."""
    for p in model.parameters():
        p.requires_grad_(False)
    axes: dict[str, int] = {}
    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    for name, module in targets(model, lora):
        device, dtype = module.weight.device, module.weight.dtype
        out_local, in_local = module.weight.shape
        module.lora_A = nn.Linear(in_local, lora.r, bias=False, device=device, dtype=dtype)
        module.lora_B = nn.Linear(lora.r, out_local, bias=False, device=device, dtype=dtype)
        reduce = None
        if isinstance(module, ColumnParallelLinear):
            axes[f"{name}.lora_B.weight"] = 0
            module.lora_A.weight.register_hook(all_reduce_hook(tp_group))
        elif isinstance(module, RowParallelLinear):
            axes[f"{name}.lora_A.weight"] = 1
            if sequence_parallel:
                reduce = lambda h, m, g=tp_group: ReduceScatterSequence.apply(h, g)  # noqa: E731
                module.lora_B.weight.register_hook(all_reduce_hook(tp_group))
            else:
                # A x may be kept by train.recompute=ops, as the layer's own partial product may
                reduce = lambda h, m, g=tp_group: ReduceFromTP.apply(h, g, m.copy_partial)  # noqa: E731
        module.register_forward_hook(_Adapter(lora.scaling, lora.dropout, reduce))
    if not axes and tp > 1:
        raise ValueError("apply_lora: a tensor-parallel group was given, but no linear is tensor-parallel")
    return axes


def adapter_count(cfg: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters of the whole model: r x (in + out) per targeted linear."""
    model = meta_model(cfg)
    return sum(lora.r * sum(linear_shape(m, 1)) for _, m in targets(model, lora))


@torch.no_grad()
def merge(model: nn.Module, lora: LoraConfig) -> None:
    """Fold each adapter into its base weight (W += (alpha / r) B A) and remove it: a plain model again,
    computing what the adapted one did. Unsharded models only."""
    for _, module in targets(model, lora):
        if not hasattr(module, "lora_A"):
            continue
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * lora.scaling
        module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
        del module.lora_A, module.lora_B
        module._forward_hooks.clear()


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """{adapter parameter name: full shape} of the whole (unsharded) model."""
    out = {}
    for name, module in targets(meta_model(cfg), lora):
        out_f, in_f = linear_shape(module, 1)
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = (lora.r, in_f), (out_f, lora.r)
    return out


def read_adapters(ckpt, cfg) -> dict[str, torch.Tensor]:
    """A LoRA run's adapters, whole and fp32, from its checkpoint `ckpt` (whatever layout wrote it)."""
    adapters = {name: torch.empty(shape) for name, shape in adapter_shapes(cfg.model, cfg.lora).items()}
    read_state(ckpt, {f"model.{n}": t for n, t in adapters.items()}, alone=True)
    return adapters
