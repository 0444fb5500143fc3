"""Fused projections for serving: q/k/v as one GEMM, gate/up as one GEMM.

At decode batch sizes a GEMM is bound by reading its weight and by its launch, so three thin products
(q, k, v) or two (gate, up) cost more than one over the concatenated weight. The concatenation is made
once, and the separate projections' parameters become views into it: parameter names, `state_dict()` and
`Engine.update_weights` (which copies into those views) are unchanged, and no weight is held twice.
Applied from outside, like the Triton kernels (fivefold.kernels): the model's classes change to
subclasses whose `project` / `gate_and_up` run the fused product. Quantized parts (fivefold.quant) of one
method and group size fuse the same way: one QuantLinear over their concatenated codes, scales and zeros,
which their buffers then view. `unfuse_projections` undoes it for an engine whose LoRA adapters hook the
separate projections, when an earlier engine fused the same model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.attention import Attention
from fivefold.model.layers import MLP
from fivefold.model.swap import derived_class
from fivefold.quant.formats import QuantizedWeight
from fivefold.quant.linear import QuantLinear
from fivefold.train.fused_projections import unfuse_projections as unfuse_training

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")  # the parts each fused product joins


def _fuse(module: nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Concatenate the named nn.Linear's weights (and biases) along the output; re-point each parameter at
    its rows of the result. None when they are not all plain linears of one dtype and device."""
    linears = [getattr(module, n) for n in names]
    if not all(type(m) is nn.Linear for m in linears):  # quantized, LoRA-wrapped, tensor-parallel: left alone
        return None
    weights = [m.weight for m in linears]
    if len({(w.dtype, w.device) for w in weights}) != 1 or any(w.device.type == "meta" for w in weights):
        return None
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start:start + rows]
        if bias is not None:
            m.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


class FusedAttention(Attention):
    linear_fn = staticmethod(F.linear)  # fivefold.serve.cpu_linear puts oneDNN's here on a CPU

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side: (..., q + 2 kv)."""
        return self.linear_fn(x, self.qkv_weight, self.qkv_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv(x).split(self.qkv_sizes, dim=-1)

    def forward(self, x: torch.Tensor, rope, mask, kv_cache=None) -> torch.Tensor:
        """On the engine's kernel path with serve.fuse_launches (a PagedBatch's `fused_launches`), RoPE runs inside the KV store's launch,
        reading q, k and v in place from the fused product (PagedBatch.attend_rotary); elsewhere
        Attention.forward."""
        if not (self.use_rope and getattr(kv_cache, "fused_launches", False)):
            return super().forward(x, rope, mask, kv_cache)
        # contiguous(): a few rows read from quantized codes on a CPU come out as an (out, rows) view, and the
        # store reads rows (a no-op for every other product)
        q, k, v = self.qkv(x).contiguous().split(self.qkv_sizes, dim=-1)  # (1, T, width) column slices of one product
        t, d = q.shape[1], self.head_dim
        cos, sin = rope  # (1, 1, T, d)
        out = kv_cache.attend_rotary(self.layer_idx, q[0].view(t, -1, d), k[0].view(t, -1, d), v[0].view(t, -1, d),
                                     cos[0, 0], sin[0, 0])  # (T, H, d)
        return self.o_proj(out.view(1, t, -1))


class FusedMLP(MLP):
    linear_fn = staticmethod(F.linear)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """gate and up side by side: (..., 2 ffn)."""
        return self.linear_fn(x, self.gate_up_weight, self.gate_up_bias)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up(x).chunk(2, dim=-1)


class FusedQuantAttention(FusedAttention):
    """q/k/v quantized alike (fivefold.quant): one QuantLinear over their concatenated codes (`qkv_quant`,
    not a submodule: the state dict keeps the parts' names), whose buffers the parts' buffers view."""

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv_quant(x)


class FusedQuantMLP(FusedMLP):
    """gate/up quantized alike: one QuantLinear over their codes (`gate_up_quant`, not a submodule)."""

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up_quant(x)


def _fuse_quantized(module: nn.Module, names: tuple[str, ...]) -> QuantLinear | None:
    """One QuantLinear over the named QuantLinears' codes, scales and zeros concatenated along the output
    (per-row int8 scales and per-row-group int4 ones stay each row's), each part's buffers re-pointed at
    its rows; None unless they share a method, group size, compute dtype, device and bias presence."""
    parts = [getattr(module, n) for n in names]
    if not all(type(m) is QuantLinear for m in parts):
        return None
    keys = {(m.method, m.group_size, m.in_features, m.dtype, m.qweight.device, m.bias is not None) for m in parts}
    if len(keys) != 1:
        return None
    with torch.no_grad():
        stored = {k: torch.cat([m._buffers[k] for m in parts]) for k in ("qweight", "scales", "zeros")
                  if parts[0]._buffers.get(k) is not None}
        bias = torch.cat([m.bias.detach() for m in parts]) if parts[0].bias is not None else None
    out = sum(m.out_features for m in parts)
    fused = QuantLinear(QuantizedWeight(parts[0].method, (out, parts[0].in_features), parts[0].group_size,
                                        stored["qweight"], stored["scales"], stored.get("zeros")),
                        None, parts[0].dtype)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in parts:
        rows = slice(start, start + m.out_features)
        for k, t in stored.items():
            m._buffers[k] = t[rows]
        if bias is not None:
            m.bias.data = fused.bias.data[rows]
        start += m.out_features
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every attention's q/k/v and every SwiGLU MLP's gate/up in place (after the model is on its
    device and dtype: moving it later would copy the parts apart); the number of fused modules, these and
    those an earlier engine fused. Such a module whose parts were replaced since is unfused first."""
    unfuse_projections(model, stale_only=True)
    unfuse_training(model)  # a model that trained with fused projections: its own classes back, then fused here
    fused = 0
    for module in model.modules():
        if _fused_parts(module) is not None:
            fused += 1
        elif type(module) is Attention:
            parts = _fuse(module, QKV)
            quantized = None if parts else _fuse_quantized(module, QKV)
            if parts:
                module.qkv_weight, module.qkv_bias = parts
                module.__class__ = FusedAttention
            elif quantized is not None:
                module.__dict__["qkv_quant"] = quantized  # not a submodule: names and state dict unchanged
                module.__class__ = FusedQuantAttention
            if parts or quantized is not None:
                module.qkv_sizes = [getattr(module, n).out_features for n in QKV]
                fused += 1
        elif isinstance(module, MLP) and module.swiglu and type(module).__name__ in ("MLP", "TritonMLP"):
            parts = _fuse(module, GATE_UP)
            quantized = None if parts else _fuse_quantized(module, GATE_UP)
            if parts:
                module.gate_up_weight, module.gate_up_bias = parts
            elif quantized is not None:
                module.__dict__["gate_up_quant"] = quantized
            if parts or quantized is not None:
                module.__class__ = _fused_mlp_class(type(module), quantized is not None)
                fused += 1
    return fused


def _fused_parts(module: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(fused weight's name, the parts' names, the attributes fusing added) of a fused module, else None."""
    if isinstance(module, FusedQuantAttention):
        return "qkv_quant", QKV, ("qkv_quant", "qkv_sizes")
    if isinstance(module, FusedAttention):
        return "qkv_weight", QKV, ("qkv_weight", "qkv_bias", "qkv_sizes")
    if isinstance(module, MLP) and "gate_up_quant" in module.__dict__:  # FusedQuantMLP, or the Triton MLP's twin
        return "gate_up_quant", GATE_UP, ("gate_up_quant",)
    if isinstance(module, MLP) and hasattr(module, "gate_up_weight"):
        return "gate_up_weight", GATE_UP, ("gate_up_weight", "gate_up_bias")
    return None


def _codes(module: nn.Module) -> torch.Tensor | None:
    """What a part or a fused product computes from: a linear's weight, a QuantLinear's codes."""
    if isinstance(module, QuantLinear):
        return module.qweight
    return module.weight if isinstance(module, nn.Linear) else None


def _is_view_of(part: nn.Module, fused: torch.Tensor | QuantLinear) -> bool:
    mine, theirs = _codes(part), _codes(fused) if isinstance(fused, nn.Module) else fused
    return mine is not None and mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()


def unfuse_projections(model: nn.Module, stale_only: bool = False) -> int:
    """Undo `fuse_projections` in place: each part's weight (and bias) its own contiguous tensor again, with
    the same values, and the modules' own classes back; the number of modules unfused. `stale_only`: only
    modules whose fused product no longer computes their parts (a part replaced since, e.g. quantized by
    fivefold.quant on a model an engine had fused)."""
    unfused = 0
    for module in model.modules():
        found = _fused_parts(module)
        if found is None:
            continue
        fused_name, parts, attrs = found
        fused = getattr(module, fused_name)
        if stale_only and all(_is_view_of(getattr(module, name), fused) for name in parts):
            continue
        with torch.no_grad():
            for name in parts:  # views into the fused weight (input-major on a CPU, fivefold.serve.cpu_linear)
                linear = getattr(module, name)
                if not _is_view_of(linear, fused):
                    continue
                if isinstance(linear, QuantLinear):
                    for key, t in linear._buffers.items():
                        if t is not None:
                            linear._buffers[key] = t.clone()
                else:
                    linear.weight.data = linear.weight.detach().clone(memory_format=torch.contiguous_format)
                if linear.bias is not None:
                    linear.bias.data = linear.bias.detach().clone()
        for attr in (*attrs, "linear_fn"):
            module.__dict__.pop(attr, None)
        module.__class__ = _unfused_class(type(module))
        unfused += 1
    return unfused


def _unfused_class(cls: type) -> type:
    """FusedAttention / FusedQuantAttention -> Attention, Fused<X>MLP / FusedQuantMLP -> <X>MLP."""
    return _unfused_class(cls.__bases__[0]) if cls.__bases__[0] in (FusedAttention, FusedMLP) else cls.__bases__[0]


def _fused_mlp_class(cls: type, quantized: bool) -> type:
    """FusedMLP / FusedQuantMLP, or a fused subclass of the Triton MLP (whose forward calls gate_and_up too)."""
    fused = FusedQuantMLP if quantized else FusedMLP
    if cls is MLP:
        return fused
    return derived_class(cls, "FusedQuant" if quantized else "Fused", lambda: {
        "gate_up": fused.gate_up, "gate_and_up": FusedMLP.gate_and_up, "linear_fn": FusedMLP.__dict__["linear_fn"]})
