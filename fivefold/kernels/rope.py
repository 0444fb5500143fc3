"""Rotary position embeddings (Su et al. 2021) as a Triton kernel, in the rotate-half layout of
fivefold.model.rope.apply_rope: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).

One program per (batch, position) rotates every head: cos and sin are read once for all heads, and x
is read through its strides, so q and k straight from the (B, S, H, d) -> (B, H, S, d) transpose need
no copy. Backward is the same kernel rotating the other way (the transpose of the rotation), so
nothing but cos and sin is saved. Arithmetic is in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seq_len"])  # a serving step's token count changes every step
def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, n_heads,
            sx_b, sx_h, sx_s, sc_b, sc_s, ss_b, ss_s, so_b, so_h, so_s,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, s = pid // seq_len, pid % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)  # (BLOCK_H, 1); heads x stride may pass 2**31
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF): one half of the head dimension
    col_mask = cols < HALF
    mask = (heads < n_heads) & col_mask
    cos = cos_ptr + b * sc_b + s * sc_s + cols
    sin = sin_ptr + b * ss_b + s * ss_s + cols
    cos1 = tl.load(cos, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF, mask=col_mask, other=0.0).to(tl.float32)
    x = x_ptr + b * sx_b + s * sx_s + heads * sx_h + cols
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the gradient: out1 = x1 cos1 - x2 sin1 and out2 = x2 cos2 + x1 sin2, transposed
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    out = out_ptr + b * so_b + s * so_s + heads * so_h + cols
    tl.store(out, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x (B, H, S, d) any strides; cos, sin (B or 1, 1, S, d)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    cos, sin = cos.expand(b, 1, s, d), sin.expand(b, 1, s, d)  # a broadcast batch reads with stride 0
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty_like(x)  # keeps x's layout, as the eager expression does
    if out.numel():
        _rotate[(b * s,)](x, cos, sin, out, s, h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                          cos.stride(2), sin.stride(0), sin.stride(2), out.stride(0), out.stride(1),
                          out.stride(2), HALF=d // 2, BLOCK_H=triton.next_power_of_2(h),
                          BLOCK_HALF=triton.next_power_of_2(d // 2), INVERSE=inverse)
    return out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_heads(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_heads(grad, cos, sin, inverse=True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fivefold.model.rope.apply_rope on x (B, H, S, d) with cos, sin (B, 1, S, d); cos and sin are
    constants here (the model computes them from a buffer), so they get no gradient."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("the Triton RoPE gives cos and sin no gradient; use fivefold.model.rope.apply_rope")
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE rotates pairs of the head dimension; {x.shape[-1]} is odd")
    return RoPEFunction.apply(x, cos, sin)
