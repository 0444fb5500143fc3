"""QLoRA (Dettmers et al. 2023): LoRA on a frozen base whose transformer linears are stored in 4 bits.

Every linear of the blocks (q, k, v, o, gate, up, down, adapted or not) keeps its weight as int4 group-wise
codes with a float16 scale and a zero point per group (fivefold.quant.formats: about 0.5 byte per parameter
plus 3 bytes per group), made from the fp32 value at materialisation, one weight at a time, and on each
tensor-parallel rank from its own slice. The embedding, the norms and the LM head stay in the compute
dtype. Where QLoRA uses NF4 with double-quantized scales, fivefold uses its own asymmetric int4 format, so
the same weights can be served (documented difference).

The forward dequantizes the weight for one matmul and drops it; the backward dequantizes it again for the
input gradient (the weight itself has none). So no dequantized weight outlives its matmul: what a frozen
linear keeps for backward is its codes, which are there anyway.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import LoraConfig
from fivefold.finetune.lora import MODULES, targets
from fivefold.parallel.tensor_parallel import RowParallelLinear
from fivefold.quant.formats import QuantizedWeight, quantize_int4

QUANTIZED = ("qweight", "scales", "zeros")


class _QuantizedMatmul(torch.autograd.Function):
    """x W^T with W dequantized from `module`'s codes in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return F.linear(x, dequantized(module, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ dequantized(ctx.module, grad.dtype), None


def dequantized(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    qw = QuantizedWeight("int4", module.quantized_shape, module.group_size, module.qweight, module.scales,
                         module.zeros)
    return qw.dequantize(dtype)


def _matmul(ref: weakref.ref, x: torch.Tensor, bias: bool) -> torch.Tensor:
    # The module holds this function: a weak reference back keeps the two out of a cycle, so dropping the
    # model frees its codes at once (the module is alive whenever it is called).
    module = ref()
    y = _QuantizedMatmul.apply(x, module)
    return y + module.bias if bias and module.bias is not None else y


def quantize_base(model: nn.Module, lora: LoraConfig, value_of, device: torch.device) -> list[str]:
    """Replace each block linear's weight Parameter of `model` (meta) by int4 codes made from
    `value_of(name)` (this rank's fp32 part), one weight at a time. Returns the quantized weights' names."""
    every = LoraConfig(r=1, targets=",".join(MODULES))  # all seven linears, adapted or not
    names = []
    for prefix, module in targets(model, every):
        name = f"{prefix}.weight"
        value = value_of(name).to(device)
        qw = quantize_int4(value, lora.group_size)
        del value
        del module.weight  # the meta Parameter: from here on the codes are the weight
        module.quantized_shape, module.group_size = qw.shape, lora.group_size
        for key in QUANTIZED:
            module.register_buffer(key, getattr(qw, key))
        ref = weakref.ref(module)
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_matmul, ref, bias=True)
        else:  # tensor-parallel: the layer's own communication around the local product
            module.matmul = functools.partial(_matmul, ref, bias=not isinstance(module, RowParallelLinear))
        names.append(name)
    return names


def quantized_weight_bytes(numel: int, group_size: int) -> float:
    """Bytes of an int4 weight of `numel` elements (fivefold.quant.formats.expected_bytes, per element)."""
    return numel / 2 + 3 * numel / group_size
