"""Inference with quantized weights: QuantLinear, and swapping a model's linears for it.

The forward never keeps a dequantized weight: the codes are the only copy held (that is the point). A few
rows on a CPU (decodes of up to ROWS_READ_FROM_CODES sequences: 8 for int8, 16 for int4) take compiled
products that read the int8 or int4 codes in place (fivefold.quant.cpu_gemv); everything else dequantizes
each weight for its product and drops it: memory at 8 or 4 bits, compute at the compute dtype's matmul speed
plus one unpack. torch's weight-only int8 kernel (`torch._weight_int8pack_mm`) is not used: on the project's
2-vCPU CPU it took 534 us for one row of a 3072 x 576 weight and 37 ms for 64, where dequantizing and multiplying
took 161 us and 2.4 ms (its time grows with the rows as if it read the weight once per row). Every path
equals F.linear(x, qw.dequantize(dtype), bias) to float rounding (tested).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.quant.cpu_gemv import ROWS_READ_FROM_CODES, quantized_rows
from fivefold.quant.formats import QuantizedWeight

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


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

    # The product of a dequantized weight; fivefold.serve puts oneDNN's here on a CPU.
    linear_fn = staticmethod(F.linear)

    def _rows_from_codes(self, x: torch.Tensor) -> torch.Tensor | None:
        """A few rows on a CPU: the compiled products that read the codes directly (fivefold.quant.cpu_gemv),
        in float32 (a bfloat16 / float16 row is widened, the result cast back); None otherwise, or where
        they cannot compile."""
        method = "int8" if self.method == "int8" else "int4"  # gptq is stored as int4
        rows = x.numel() // self.in_features
        if rows > ROWS_READ_FROM_CODES[method] or x.dtype not in _FLOATS or x.device.type != "cpu" \
                or self.qweight.device.type != "cpu":
            return None
        y = quantized_rows(method, x.reshape(rows, self.in_features).float(), self.qweight, self.scales, self.zeros,
                           self.group_size)
        return None if y is None else y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        y = self._rows_from_codes(x)
        if y is None:
            y = self.linear_fn(x, self.quantized().dequantize(x.dtype))
        return y if self.bias is None else y + self.bias


def warm_up_codes_products(model: nn.Module) -> tuple[int, float]:
    """Compile the codes-reading products (fivefold.quant.cpu_gemv) now for `model`'s quantized linears on a
    CPU, one and two rows per method and group layout, so that no decode step waits for the
    compiler; (the calls made, seconds)."""
    start, seen = time.perf_counter(), set()
    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, QuantLinear) and module.dtype in _FLOATS and module.qweight.device.type == "cpu":
                key = (module.method, module.group_size == module.in_features)
                if key not in seen:
                    seen.add(key)
                    for rows in (1, 2):  # the one-row kernel, and the one for several rows
                        module(torch.zeros(rows, module.in_features, dtype=module.dtype))
    return len(seen), time.perf_counter() - start


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
