"""Inference with quantized weights: QuantLinear, and swapping a model's linears for it.

The forward never keeps a dequantized weight: the codes are the only copy held (that is the point), so
int4 / gptq dequantize for each matmul and drop the result: memory at 4 bits, compute at the compute
dtype's matmul speed plus one unpack. int8 on the CPU uses torch's weight-only int8 kernel
(`torch._weight_int8pack_mm`: x (M, K) in fp32 / bf16 / fp16 times int8 (N, K) scaled per row), which
reads the int8 codes directly; anywhere else (CUDA, other dtypes, a torch without it) int8 dequantizes too.
Every path equals F.linear(x, qw.dequantize(dtype), bias) to float rounding (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.quant.formats import QuantizedWeight

_INT8_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as a QuantizedWeight's tensors (buffers `qweight`, `scales`, `zeros`), so a
    state dict holds `<name>.qweight` where the linear had `<name>.weight`; the bias stays a (frozen)
    parameter under its own name. `dtype`: the compute dtype (the rest of the model's)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.method, self.group_size = qw.method, qw.group_size
        self.out_features, self.in_features = qw.shape
        self.dtype = dtype
        for key in ("qweight", "scales", "zeros"):  # zeros: None for int8
            self.register_buffer(key, getattr(qw, key))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.method, (self.out_features, self.in_features), self.group_size,
                               self.qweight, self.scales, self.zeros)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) casts every floating buffer: the scales would lose bits (float16 -> bf16
        # is not exact). They keep their stored dtype and only move; the compute dtype follows the cast.
        stored = {k: t for k, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for key, t in stored.items():
            if self._buffers[key].dtype != t.dtype:
                self._buffers[key] = t.to(self._buffers[key].device)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def _int8_kernel(self, x: torch.Tensor) -> bool:
        return (self.method == "int8" and hasattr(torch, "_weight_int8pack_mm") and x.device.type == "cpu"
                and self.qweight.device.type == "cpu" and x.dtype in _INT8_KERNEL_DTYPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self._int8_kernel(x):
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.qweight,
                                          self.scales.view(-1).to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.quantized().dequantize(x.dtype))
        return y if self.bias is None else y + self.bias


def swap_linears(model: nn.Module, qweights: dict[str, QuantizedWeight]) -> list[str]:
    """Replace each nn.Linear named by a key of `qweights` ("<module>.weight") with a QuantLinear in
    place, computing in the linear's dtype; every other parameter keeps its name. Returns the modules."""
    swapped = []
    for name, qw in qweights.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{path} is a {type(linear).__name__}, not an nn.Linear")
        if tuple(linear.weight.shape) != tuple(qw.shape):
            raise ValueError(f"{name} has shape {tuple(linear.weight.shape)}, the quantized weight {qw.shape}")
        setattr(parent, attr, QuantLinear(qw, linear.bias, linear.weight.dtype))
        swapped.append(path)
    return swapped
