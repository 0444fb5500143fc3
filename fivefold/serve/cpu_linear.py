"""The serving model's linears on a CPU through oneDNN (serve.linear).

F.linear on a CPU runs MKL: at a decode's few rows its sgemv reads the weights on one thread, 17 GB/s on
this project's 2-vCPU machine where a sum over the same tensors reads 45-48 GB/s, and its GEMMs of a few
dozen rows are little better. oneDNN's inner product (`mkldnn._linear_pointwise`, the op torch.compile's CPU
backend emits for a linear) spreads both over the threads: on the same machine it reads ~24-37 GB/s at one
row, and `bench/serve.py` measures what that gives a whole engine.

The block products' weights are also laid out input-major: the same (out, in) parameter, stored as the
transpose of an (in, out) contiguous tensor. oneDNN's kernels read that layout's rows of outputs as they
stream, and on the 2-vCPU machine the projections narrower than about twice their input ran 10-70% faster at
1-32 rows (o_proj 24 -> 41 GB/s at one row, down_proj 28 -> 40) and the same at 2,048. The LM head keeps its
layout: it is the embedding too where they are tied, whose lookups read rows. Nothing is held twice (each
weight is re-laid one at a time), names and shapes are unchanged, and `Engine.update_weights` still copies
into the same parameters; this is a choice of kernel and layout only: the same product, summed in another
order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.serve.fused import FusedAttention


def onednn_available() -> bool:
    """torch was built with oneDNN and has the inner-product op (every x86 and aarch64 CPU wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on oneDNN: x (..., in), weight (out, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose product runs on oneDNN; parameters, names and hooks (LoRA adapters) unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def _input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values stored as the transpose of a contiguous (in, out) tensor."""
    return weight.detach().t().contiguous().t()


def _relay(module: nn.Module, fused: str, parts: tuple[str, ...]) -> list[nn.Module]:
    """Re-lay a fused weight input-major and re-point its parts' parameters at their rows of it; the parts."""
    weight = _input_major(getattr(module, fused))
    setattr(module, fused, weight)
    start, linears = 0, [getattr(module, name) for name in parts]
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start:start + rows]
        start += rows
    return linears


def use_onednn(model: nn.Module) -> int:
    """Route every plain linear of `model` (on a CPU, in float32 or bfloat16) and its fused q/k/v and gate/up
    products through oneDNN, in place, the block products' weights laid out input-major; the number of
    products routed."""
    routed = 0
    # Laid out already or left as they are: the fused products' parts (views into the fused weight), and
    # the embedding and LM head.
    keep = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        keep.add(id(model.lm_head.weight))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FusedAttention):
                module.linear_fn = onednn_linear
                keep.update(id(m.weight) for m in _relay(module, "qkv_weight", ("q_proj", "k_proj", "v_proj")))
                routed += 1
            elif hasattr(module, "gate_up_weight"):
                module.linear_fn = onednn_linear
                keep.update(id(m.weight) for m in _relay(module, "gate_up_weight", ("gate_proj", "up_proj")))
                routed += 1
            elif type(module) is nn.Linear and module.weight.device.type == "cpu":
                module.__class__ = OneDNNLinear
                if id(module.weight) not in keep:
                    module.weight.data = _input_major(module.weight)
                routed += 1
    return routed


def serving_linear(device: torch.device, choice: str = "auto"):
    """The linear function the engine runs on `device` for serve.linear=`choice`: what calibration times."""
    if device.type == "cpu" and choice != "torch" and onednn_available():
        return onednn_linear
    return F.linear
