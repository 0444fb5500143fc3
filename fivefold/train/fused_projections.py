"""Fused projections for training: q/k/v as one GEMM, gate/up as one GEMM, each part still its own parameter.

A GEMM with few output columns runs far below the card's peak: the k and v projections of a grouped-query
model are 192 columns wide at SmolLM2-135M and 512 at Llama-3.2-1B, against 960 and 3072 for q, k and v
together (the planner's matmul knee, fivefold.planner.speed, prices exactly this). So each block's
projections of one input run as one product over their concatenated weights, forward and backward.

The parameters stay separate: names, the name-seeded init, tensor-parallel shards, ZeRO units, LoRA targets
and checkpoints see no difference. The concatenation is made per call, inside an autograd.Function that
saves only the input and the parts, so the concatenated weight is transient (made again in backward for
the input gradient) and never held across the forward. Serving fuses differently (fivefold.serve.fused):
it never trains, so its parameters become views of one weight made once.

Applied from outside, like the Triton kernels (fivefold.kernels): attention and SwiGLU MLPs change class
to subclasses whose `project` / `gate_and_up` run the fused product. A part that is not a plain linear
when the block runs (LoRA-wrapped, quantized, float8, hooked) makes that module run its separate products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.attention import Attention
from fivefold.model.layers import MLP
from fivefold.model.swap import derived_class
from fivefold.model.transformer import Block
from fivefold.parallel.tensor_parallel import ColumnParallelLinear


class FusedLinear(torch.autograd.Function):
    """y = x [W_1; ...; W_n]^T + [b_1; ...; b_n]: one product for n linears of one input. Saves the parts, and
    x when a part trains; the concatenated weight exists only inside forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *tensors: torch.Tensor) -> torch.Tensor:
        weights, biases = tensors[:n], tensors[n:]
        ctx.n, ctx.rows = n, [w.shape[0] for w in weights]
        # the input only for the weights' gradients: frozen parts (LoRA's base) keep no activation
        ctx.save_for_backward(x if any(ctx.needs_input_grad[2:2 + n]) else None, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        n, need = ctx.n, ctx.needs_input_grad
        # The input gradient multiplies by the concatenated weight again, made here along dim -2 where forward
        # says 0: a different expression, so torch.compile's partitioner makes it from the weights in backward
        # instead of keeping forward's across the whole forward (a weight-sized tensor per block). (The
        # transposes' concatenation used before comes out as NaN from inductor's CPU code in bf16, torch 2.13.)
        grad_x = grad.matmul(torch.cat(weights, dim=-2)) if need[0] else None
        flat = grad.reshape(-1, grad.shape[-1])  # (tokens, sum of rows)
        grad_w = [None] * n
        if x is not None:
            # One product for every part's gradient; each part's is a row block of it (as cat's backward
            # hands out slices), so no copy is made.
            parts = flat.t().mm(x.reshape(-1, x.shape[-1])).split(ctx.rows)
            grad_w = [g if need[2 + i] else None for i, g in enumerate(parts)]
        grad_b = []
        if len(need) > 2 + n:
            sums = flat.sum(0).split(ctx.rows) if any(need[2 + n:]) else [None] * n
            grad_b = [g if need[2 + n + i] else None for i, g in enumerate(sums)]
        return grad_x, None, *grad_w, *grad_b


def _plain(linear: nn.Module) -> bool:
    """Whether `linear` computes x W^T + b and nothing else: an nn.Linear, or a tensor-parallel column shard
    whose input its module prepared already, with no hooks and no replaced forward or product."""
    if type(linear) is nn.Linear:
        replaced = "forward" in linear.__dict__
    elif type(linear) is ColumnParallelLinear:
        replaced = linear.input != "ready" or "matmul" in linear.__dict__ or "forward" in linear.__dict__
    else:
        return False
    return not (replaced or linear._forward_hooks or linear._forward_pre_hooks)


def fused_product(x: torch.Tensor, linears: list[nn.Module]) -> list[torch.Tensor] | None:
    """Each linear's output (column slices of one product), or None when they cannot run as one: not all
    plain (`_plain`), of mixed dtypes, or some with a bias and some without."""
    if not all(_plain(m) for m in linears):
        return None
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears if m.bias is not None]
    if len({w.dtype for w in weights}) != 1 or len(biases) not in (0, len(weights)):
        return None
    out = FusedLinear.apply(x, len(weights), *weights, *biases)
    return list(out.split([w.shape[0] for w in weights], dim=-1))


class FusedProjectionAttention(Attention):
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = fused_product(x, [self.q_proj, self.k_proj, self.v_proj])
        if parts is None:
            return super().project(x)
        q, k, v = parts
        # v goes into attention as it is, and attention keeps it for backward: as a slice it would keep
        # the whole product alive (q and k too, which RoPE has copied by then). Its own copy costs T x kv.
        return q, k, (v.contiguous() if self.use_rope else v)


def _fused_gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parts = fused_product(x, [self.gate_proj, self.up_proj])
    return MLP.gate_and_up(self, x) if parts is None else tuple(parts)


def apply_fused_projections(model: nn.Module, qkv: bool = True, gate_up: bool = True) -> int:
    """Fuse every block's q/k/v (`qkv`) and its dense SwiGLU MLP's gate/up (`gate_up`; not a mixture's shared
    expert), in place (meta or materialised; before torch.compile and recomputation wrap the blocks).
    Config.fused_projections chooses them, for the plans too. Returns the number of modules swapped."""
    swapped = 0
    for block in model.modules():
        if not isinstance(block, Block):
            continue
        if qkv and type(block.attn) is Attention:
            block.attn.__class__ = FusedProjectionAttention
            swapped += 1
        mlp = block.mlp
        if gate_up and isinstance(mlp, MLP) and mlp.swiglu and type(mlp).__name__ in ("MLP", "TritonMLP"):
            # (the plain MLP or the Triton one, whose forward calls gate_and_up too)
            mlp.__class__ = derived_class(type(mlp), "FusedProjection", lambda: {"gate_and_up": _fused_gate_and_up})
            swapped += 1
    return swapped


def unfuse_projections(model: nn.Module) -> int:
    """Undo apply_fused_projections (serving fuses its own way): each module's class back to its base."""
    count = 0
    for module in model.modules():
        if type(module) is FusedProjectionAttention or getattr(type(module), "gate_and_up", None) is _fused_gate_and_up:
            module.__class__ = type(module).__bases__[0]
            count += 1
    return count
