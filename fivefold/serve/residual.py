"""Residual adds folded into the RMSNorm that reads them, on the engine's Triton path.

A block adds attention's output to the residual stream and normalises the sum for the MLP, then adds the
MLP's output and the next block normalises that: two elementwise launches and two norms a block, each
reading the stream again. At a decode step's few rows every launch costs more than the bytes it moves
(a CUDA graph still runs each kernel with its own start-up), so here each add and the norm after it are
one kernel (fivefold.kernels.rmsnorm.add_rms_norm), computed as the separate ops compute them: the
logits are the model's, bit for bit. Applied from outside, like the fused projections
(fivefold.serve.fused): the model's class changes to a subclass whose forward runs this loop when the
batch is the engine's kernel path with serve.fuse_launches, and Transformer.forward otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.kernels.rmsnorm import TritonRMSNorm, add_rms_norm
from fivefold.model import ForwardContext
from fivefold.model.transformer import Block, Transformer
from fivefold.serve.hooks import hooked


class FusedResidualTransformer(Transformer):
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        # A hook added since the swap (a memory tracker's, a user's) must run: then Transformer.forward.
        if ctx is None or not getattr(ctx.kv_cache, "fused_launches", False) or _hooked(self):
            return super().forward(input_ids, ctx)
        positions = self.positions(input_ids, ctx)
        x = self.embed(input_ids, positions)
        rope, mask = self.context(input_ids, positions, ctx, x.dtype)
        layers = list(self.layers)
        h = layers[0].attn_norm(x)
        for i, layer in enumerate(layers):
            x, h = add_rms_norm(x, layer.attn(h, rope, mask, ctx.kv_cache), layer.mlp_norm.weight, layer.mlp_norm.eps)
            delta = layer.mlp(h)
            if i + 1 < len(layers):
                norm = layers[i + 1].attn_norm
                x, h = add_rms_norm(x, delta, norm.weight, norm.eps)
            else:  # the final norm reads only the sampled rows (Transformer.forward's order)
                x = x + delta
        if ctx.logits_at is not None:
            x = x.reshape(-1, x.shape[-1])[ctx.logits_at]
        return self.head(x)


def _hooked(model: Transformer) -> bool:
    """Whether the model, a block or a block's norm has a forward hook, which the fused loop would skip."""
    modules = [model, *model.layers, *(n for layer in model.layers for n in (layer.attn_norm, layer.mlp_norm))]
    return any(hooked(m) for m in modules)


def fuse_residuals(model: nn.Module) -> bool:
    """Make `model` a FusedResidualTransformer in place when its forward is the plain loop over blocks this
    one reproduces: a Transformer of Blocks whose norms run the Triton RMSNorm, with no hooks on the model,
    its blocks or their norms (tensor parallelism and recomputation place some there); checked again on
    every call, as an earlier engine's swap may have been followed by hooks. Whether it now is one."""
    if type(model) not in (Transformer, FusedResidualTransformer) or not len(model.layers):
        return False
    if not all(type(layer) is Block and type(layer.attn_norm) is TritonRMSNorm and type(layer.mlp_norm) is TritonRMSNorm
               for layer in model.layers) or _hooked(model):
        return False
    model.__class__ = FusedResidualTransformer
    return True
