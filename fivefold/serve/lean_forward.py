"""The serving step on the engine's torch path (a CPU) as one loop over the blocks' tensor ops.

At a decode step's few rows every op moves a few kilobytes, so a block's time outside its products is the
per-call overhead of its ~45 tensor ops and ~10 module calls: on the 2-vCPU test machine ~270 us a block,
a third of a `smollm2-135m` token (bench/serve_decode_breakdown.py). This loop computes the same block with
fewer ops and no module calls: RMSNorm as one `F.rms_norm` where that is the model's formula bit for bit
(float32), q and k rotated together in the fused product's layout (a roll and three elementwise ops where
`apply_rope` took six for each), the keys, values and attention in the tokens' own (T, heads, d) layout
(no transposes to and from (1, heads, T, d)), and the residual adds as plain adds. Each op computes what
the module path computes, so the logits are those of `Transformer.forward` bit for bit (tested). Measured
against the modules in one process (bench/serve_cpu_ab.py --compare lean): +3% at batch 1 and at 16 requests;
in a real step each small op costs about twice what it costs alone (it follows a product that evicted the
caches), so the loop saves ~1.3 ms of a ~21 ms token, not the whole overhead.

Under serve.cpu_kernel (float32 or bfloat16, where the CPU kernels build) the loop's norms (each with the
residual add before it) and SwiGLU are C++ calls, and on a decode-only step so are RoPE, the KV store and the attention together
(fivefold.kernels.cpu_block_ops): +15% at batch 1 (bench/serve_cpu_ab.py --compare block-ops). Where C++ can run
all four products of every block (the rows kernel, torch's linear; not oneDNN's), a decode-only step's blocks
are one C++ call doing the same (decode_blocks, equal bit for bit; +11% at batch 1, --compare one-call). The
logits then equal the modules' to float32 rounding (in bfloat16, within its rounding), not bit for bit (the norm
sums in another order); the
loop's torch ops (TORCH_OPS) stay the reference, tested bit for bit.

Applied from outside, like the fused projections (fivefold.serve.fused): the model's class changes to a
subclass whose forward runs this loop when the batch is the engine's torch path with serve.fuse_launches,
and Transformer.forward otherwise. Only a model this loop reproduces takes it: Blocks of RMSNorm, attention
with RoPE whose q/k/v run as one product, and a SwiGLU MLP whose gate/up do too (full precision or quantized
alike), with no hooks on any of their modules (adapters, tensor parallelism and memory trackers place theirs
there), checked on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from fivefold.kernels.cpu_block_ops import add_rms_norm_rows, decode_blocks, rms_norm_rows, silu_mul_rows
from fivefold.kernels.cpu_build import DTYPES
from fivefold.model import ForwardContext
from fivefold.model.layers import RMSNorm
from fivefold.model.rope import apply_rope, rope_cos_sin
from fivefold.model.transformer import Block, Transformer
from fivefold.serve.cpu_linear import RoutedLinear, cpp_product
from fivefold.serve.fused import FusedAttention, FusedMLP, FusedQuantAttention, FusedQuantMLP
from fivefold.serve.hooks import hooked


class LeanTransformer(Transformer):
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        cache = None if ctx is None else ctx.kv_cache
        blocks = lean_blocks(self) if getattr(cache, "lean", False) else None
        if blocks is None:
            return super().forward(input_ids, ctx)
        positions = self.positions(input_ids, ctx)
        x = self.embed(input_ids, positions)[0]  # (T, h)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)  # (1, 1, T, d)
        half = cos.shape[-1] // 2
        cos, sin = cos[0, 0, :, None], sin[0, 0, :, None]  # (T, 1, d)
        # apply_rope's x * cos + cat(-x2, x1) * sin, as x * cos + cat(x2, x1) * cat(-sin1, sin2): a negation
        # moved from one factor to the other, exact in floating point.
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        norm = kernel_norm if block_kernels(cache, x) else rms_norm
        x = self.run_blocks(blocks, x, cos, signed_sin, half, cache)
        if ctx.logits_at is not None:
            x = x[ctx.logits_at]
        return self.lm_head.forward(norm(self.norm, x))

    def run_blocks(self, blocks, x, cos, signed_sin, half: int, cache) -> torch.Tensor:
        """The blocks over x (T, h); fivefold.serve.compiled_decode compiles this on some steps. Under
        serve.cpu_kernel (float32, bfloat16) the norms and SwiGLU are C++ calls, and a decode-only step's RoPE, KV
        store and attention one more (fivefold.kernels.cpu_block_ops); a decode-only step whose products C++ can
        run (the rows kernel, torch's linear) is one C++ call for every block (decode_blocks)."""
        def attend(attn, q, k, v):
            return cache.attend_heads(attn.layer_idx, q, k, v, attn.core.forward)
        if not block_kernels(cache, x):
            return blocks_loop(blocks, x, cos, signed_sin, half, attend)
        out = self.one_call(blocks, x, cos, signed_sin, cache)
        if out is not None:
            return out
        cos_rows, sin_rows = cos[:, 0], signed_sin[:, 0]  # (T, d), contiguous

        def rotary_attend(attn, heads, q_heads):
            return cache.attend_rotary_rows(attn.layer_idx, heads, q_heads, cos_rows, sin_rows)
        return blocks_loop(blocks, x, cos, signed_sin, half, attend, KERNEL_OPS,
                           rotary_attend if cache.kernel_whole else None)

    @staticmethod
    def one_call(blocks, x, cos, signed_sin, cache) -> torch.Tensor | None:
        """A decode-only step's blocks as one C++ call (decode_blocks) where `one_call_blocks` allows it, under
        the block kernels; else None."""
        if not (block_kernels(cache, x) and cache.kernel_whole):
            return None
        one_call = one_call_blocks(blocks, x.shape[0])
        if one_call is None:
            return None
        params, eps, products = one_call
        pools = [cache.pool.blocks(b[1].layer_idx) for b in blocks]
        return decode_blocks(x, params, eps, products, blocks[0][1].qkv_sizes[0] // blocks[0][1].head_dim,
                             cos[:, 0], signed_sin[:, 0], [k for k, _ in pools], [v for _, v in pools],
                             cache.dev.slot_mapping, cache.decode_tables, cache.decode_lens)


def block_kernels(cache, x: torch.Tensor) -> bool:
    """Whether this step's loop runs the C++ block ops: the batch asks for them (serve.cpu_kernel) and x is float32
    or bfloat16."""
    return getattr(cache, "block_kernels", False) and x.dtype in DTYPES


LINEARS = (nn.Linear, RoutedLinear)  # the o and down projections decode_blocks can run in C++


def one_call_blocks(blocks, rows: int) -> tuple[list[torch.Tensor], list[float], list[int]] | None:
    """decode_blocks' params, eps and products for `blocks` (`lean_blocks`) at `rows` rows: where every block is
    full precision, with no bias but q/k/v's, and C++ can run each of its four products as the loop would
    (fivefold.serve.cpu_linear.cpp_product: the rows kernel or torch's linear, not oneDNN's). Else None (the
    loop calls the ops one by one)."""
    params, eps, products = [], [], []
    empty = torch.empty(0)
    for attn_norm, attn, o_proj, mlp_norm, mlp, down_proj in blocks:
        if not (type(attn) is FusedAttention and type(mlp) is FusedMLP and type(o_proj) in LINEARS
                and type(down_proj) in LINEARS and o_proj.bias is None and down_proj.bias is None
                and mlp.gate_up_bias is None):
            return None
        weights = (attn.qkv_weight, o_proj.weight, mlp.gate_up_weight, down_proj.weight)
        kinds = [cpp_product(getattr(m, "linear_fn", F.linear), rows, w)  # a plain nn.Linear runs F.linear
                 for m, w in zip((attn, o_proj, mlp, down_proj), weights)]
        if None in kinds or weights[0].dtype not in DTYPES or any(w.dtype != weights[0].dtype for w in weights):
            return None
        bias = attn.qkv_bias if attn.qkv_bias is not None else empty
        params += [attn_norm.weight, weights[0], bias, weights[1], mlp_norm.weight, weights[2], weights[3]]
        eps += [attn_norm.eps, mlp_norm.eps]
        products += kinds
    return params, eps, products


def blocks_loop(blocks, x, cos, signed_sin, half: int, attend, ops: LoopOps | None = None,
                rotary_attend=None) -> torch.Tensor:
    """Each block of `lean_blocks` over x (T, h); `attend(attn, q, k, v)` is the attention, q (T, H, d), k and
    v (T, Hkv, d), q and k rotated; `ops` the norms' and SwiGLU's (default: torch's, TORCH_OPS);
    `rotary_attend(attn, heads, q_heads)`, where given, rotates, stores and attends from the unrotated q/k/v
    heads (T, q_heads + 2 Hkv, d) instead."""
    add_norm, swiglu = ops or TORCH_OPS
    t = x.shape[0]
    delta = None  # the last block's MLP output, added to x with the next norm
    for attn_norm, attn, o_proj, mlp_norm, mlp, down_proj in blocks:
        d = attn.head_dim
        x, normed = add_norm(attn_norm, x, delta)
        heads = attn.qkv(normed).view(t, -1, d)
        del delta, normed
        nq, nk = attn.qkv_sizes[0] // d, attn.qkv_sizes[1] // d
        if rotary_attend is not None:
            out = rotary_attend(attn, heads, nq)
        else:
            qk = heads[:, :nq + nk]
            qk = qk * cos + qk.roll(half, -1) * signed_sin
            out = attend(attn, qk[:, :nq], qk[:, nq:], heads[:, nq + nk:])
            del qk
        del heads  # a prefill chunk's peak is in the MLP: nothing of the attention is held there
        x, normed = add_norm(mlp_norm, x, o_proj.forward(out.reshape(t, -1)))
        del out
        gate_up = mlp.gate_up(normed)
        del normed
        act = swiglu(gate_up)
        del gate_up  # before the down product's output exists
        delta = down_proj.forward(act)
        del act  # else held until the next block's product is written: two at once
    return x + delta


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_add_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        x = x + delta
    return x, rms_norm(norm, x)


def kernel_add_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_add_norm as one C++ call (float32 or bfloat16; equal to float32 rounding, or within a bfloat16 step,
    fivefold.kernels.cpu_block_ops)."""
    if delta is None:
        return x, kernel_norm(norm, x)
    return add_rms_norm_rows(x, delta, norm.weight, norm.eps)


def kernel_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_rows(x, norm.weight, norm.eps)


class LoopOps(NamedTuple):
    """The loop's norms (`add_norm(norm, x, delta)` -> (x + delta, its norm); delta None: no add) and SwiGLU
    (`swiglu(gate_up)` -> silu(gate) * up)."""
    add_norm: Callable
    swiglu: Callable


TORCH_OPS = LoopOps(torch_add_norm, torch_swiglu)  # bit for bit the modules'
KERNEL_OPS = LoopOps(kernel_add_norm, silu_mul_rows)  # C++ calls, to float32 rounding (serve.cpu_kernel)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward's result: in float32 torch's own op gives it bit for bit (checked by the tests), in
    another dtype the module's own forward (F.rms_norm would multiply by the weight before casting back)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm.forward(x)


def _plain(module: nn.Module, *classes: type) -> bool:
    """Of exactly one of these classes, with no hook and no forward of its own set on the instance."""
    return type(module) in classes and not hooked(module) and "forward" not in module.__dict__


def lean_blocks(model: Transformer) -> list[tuple[nn.Module, ...]] | None:
    """Each block's (attn_norm, attn, o_proj, mlp_norm, mlp, down_proj) when the loop computes `model`'s
    forward: every block is one it reproduces and nothing hooks the model, a block, or a module whose work
    the loop does; else None. Read through `_modules` each call, so that a module replaced or hooked since
    the swap is seen (~3 us a block)."""
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or hooked(model)
            or model.cfg.position != "rope"):
        return None
    top = model._modules
    if not _plain(top["norm"], RMSNorm) or hooked(top["lm_head"]) or hooked(top["embed_tokens"]):
        return None
    blocks = []
    for layer in top["layers"]._modules.values():
        parts = layer._modules
        attn, mlp = parts["attn"], parts["mlp"]
        inner, ffn = attn._modules, mlp._modules
        if not (_plain(layer, Block) and _plain(parts["attn_norm"], RMSNorm) and _plain(parts["mlp_norm"], RMSNorm)
                and _plain(attn, FusedAttention, FusedQuantAttention) and attn.use_rope and attn.rope_fn is apply_rope
                and not hooked(inner["core"]) and not hooked(inner["o_proj"])
                and _plain(mlp, FusedMLP, FusedQuantMLP) and not hooked(ffn["down_proj"])):
            return None
        blocks.append((parts["attn_norm"], attn, inner["o_proj"], parts["mlp_norm"], mlp, ffn["down_proj"]))
    return blocks or None


def use_lean_forward(model: nn.Module) -> bool:
    """Make `model` a LeanTransformer in place when this loop computes its forward (checked again on every
    call: an engine sharing the model may unfuse it, a tracker may hook it). Whether it now is one."""
    if not (type(model) is Transformer or isinstance(model, LeanTransformer)) or lean_blocks(model) is None:
        return False
    if type(model) is Transformer:
        model.__class__ = LeanTransformer
    return True
