"""The serving model's linears on a CPU through oneDNN (serve.linear).

F.linear on a CPU runs MKL: at a decode's few rows its sgemv reads the weights on one thread, 17 GB/s on
this project's 2-vCPU machine where a sum over the same tensors reads 45-48 GB/s, and its GEMMs of a few
dozen rows are little better. oneDNN's inner product (`mkldnn._linear_pointwise`, the op torch.compile's CPU
backend emits for a linear) spreads both over the threads: on the same machine it reads ~24-30 GB/s at one
row, and `bench/serve.py` measures what that gives a whole engine. The weights stay as they are (no packed
copy, nothing held twice; `Engine.update_weights` still writes them in place), so this is a choice of
kernel only: the same product, summed in another order.
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


def use_onednn(model: nn.Module) -> int:
    """Route every plain linear of `model` (on a CPU, in float32 or bfloat16) and its fused q/k/v and gate/up
    products through oneDNN, in place; the number of products routed."""
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = OneDNNLinear
            routed += 1
        elif isinstance(module, FusedAttention) or hasattr(module, "gate_up_weight"):
            module.linear_fn = onednn_linear
            routed += 1
    return routed


def serving_linear(device: torch.device, choice: str = "auto"):
    """The linear function the engine runs on `device` for serve.linear=`choice`: what calibration times."""
    if device.type == "cpu" and choice != "torch" and onednn_available():
        return onednn_linear
    return F.linear
