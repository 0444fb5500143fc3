"""RMSNorm (Zhang & Sennrich 2019) as Triton kernels, numerically the same computation as
fivefold.model.layers.RMSNorm: normalise in fp32, round to the input dtype, then apply the gain.

Forward: one program per row, so the row's sum of squares stays in registers. Backward: each program
walks a strided set of rows, writing the input gradient as it goes and keeping its share of the weight
gradient in registers; the per-program partial sums are added by one torch sum afterwards. Two steps
rather than atomics, so the weight gradient is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fivefold.model.layers import RMSNorm

MAX_HIDDEN = 65536  # one row must fit one program's registers


@triton.jit
def _forward(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols  # hidden sizes need not be powers of two
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # Rounded to the input dtype before the gain, as RMSNorm.forward (and Llama's reference) does.
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _add_forward(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    # x + d rounded to x's dtype (as the eager residual add rounds it), stored, then normalised exactly as
    # _forward normalises a row it loads.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * n_cols + cols, total, mask=mask)
    x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(x_ptr, w_ptr, grad_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_stride = n_cols.to(tl.int64)  # 64-bit offsets: rows x hidden may pass 2**31
    for row in range(pid, n_rows, tl.num_programs(0)):
        offsets = row * row_stride + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        dw += g * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        g_normed = g * w
        # The gradient of x * rsqrt(mean(x^2) + eps), contracted with g_normed.
        dx = rstd * (g_normed - normed * (tl.sum(g_normed * normed, axis=0) / n_cols))
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)


def _block(n_cols: int) -> tuple[int, int]:
    """The row's block size and a warp count that grows with it (so each thread holds ~8-16 values)."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"the Triton RMSNorm handles hidden sizes up to {MAX_HIDDEN}, not {n_cols}; "
                         f"use train.kernels=torch")
    block = triton.next_power_of_2(n_cols)
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _programs(device: torch.device, rows: int) -> int:
    """Programs of the backward. On a GPU, enough to fill the largest ones a few deep (H100: 132 SMs)
    and few enough that summing their partial rows is cheap; a constant, not a device query, so that
    torch.compile has nothing to look up. In the interpreter (tests), few: each walks several rows."""
    return min(rows, 512 if device.type == "cuda" else 4)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, N)
        m, n = rows.shape
        block, warps = _block(n)
        # The dtype of `weight * normed` in RMSNorm.forward: bf16 for bf16 weights and input.
        out = torch.empty(m, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        if m:
            _forward[(m,)](rows, weight, out, rstd, n, eps, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        m, n = rows.shape
        block, warps = _block(n)
        grad = grad.reshape(m, n).contiguous()
        dx = torch.empty_like(rows)
        programs = _programs(rows.device, m)
        dw_part = torch.empty(programs, n, dtype=torch.float32, device=rows.device)  # (P, N)
        if m:
            _backward[(programs,)](rows, weight, grad, rstd, dx, dw_part, m, n, BLOCK=block, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N), weight (N,) -> RMSNorm(x), as fivefold.model.layers.RMSNorm computes it."""
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) in one pass, for inference: a residual add and the norm that reads
    its result, each computed as the separate ops compute them (the sum rounded to x's dtype first), with
    one launch and one read of the sum instead of two launches and three. With autograd recording, the
    separate ops (this kernel has no backward)."""
    if torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad or weight.requires_grad):
        total = x + delta
        return total, rms_norm(total, weight, eps)
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"add_rms_norm needs x and delta of one shape and dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(delta.shape)} {delta.dtype}")
    n = x.shape[-1]
    rows_x, rows_d = (t.reshape(-1, n).contiguous() for t in (x, delta))
    m = rows_x.shape[0]
    block, warps = _block(n)
    total = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = torch.empty(m, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if m:
        _add_forward[(m,)](rows_x, rows_d, weight, total, out, n, eps, BLOCK=block, num_warps=warps)
    return total.view(x.shape), out.view(x.shape)


class TritonRMSNorm(RMSNorm):
    """RMSNorm whose forward runs the kernels above; fivefold.kernels.apply_kernels swaps a module's class
    to this one, so the module, its `weight` and the parameter names stay as they were."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
