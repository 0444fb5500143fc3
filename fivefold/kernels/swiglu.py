"""The SwiGLU product silu(gate) * up (Shazeer 2020) as one elementwise Triton kernel each way.

Eager PyTorch writes silu(gate) to memory and reads it back for the product, and autograd keeps it for
backward; here forward reads gate and up once and writes the product once, and backward recomputes
the sigmoid from the saved gate and up instead of keeping silu(gate). Arithmetic is in fp32, rounded
once to the inputs' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fivefold.model.layers import MLP

BLOCK = 1024


@triton.jit
def _forward(gate_ptr, up_ptr, out_ptr, n_cols, col_blocks, stride_g, stride_u, BLOCK: tl.constexpr):
    # BLOCK columns of one row per program, on a 1-D grid (a second grid axis would cap a row's blocks at
    # 65535): gate and up may be strided rows (the two halves of serving's fused gate/up product,
    # fivefold.serve.fused), read in place rather than copied first.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(gate_ptr, up_ptr, grad_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    tl.store(dgate_ptr + offsets, (dy * u * sig * (1 + g * (1 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (dy * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} "
                             f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
        if not gate.numel():  # nothing to compute (and no rows to lay out)
            ctx.save_for_backward(gate, up)
            return torch.empty_like(gate)
        shape = gate.shape
        gate, up = _rows(gate), _rows(up)
        rows, cols = gate.shape
        out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
        blocks = triton.cdiv(cols, BLOCK)
        _forward[(rows * blocks,)](gate, up, out, cols, blocks, gate.stride(0), up.stride(0), BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        grad = grad.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _backward[(triton.cdiv(n, BLOCK),)](gate, up, grad, dgate, dup, n, BLOCK=BLOCK)
        return dgate.view(grad.shape), dup.view(grad.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (non-empty) as (rows, last dimension) with contiguous rows a fixed stride apart: a view where its
    leading dimensions flatten into one (the halves of a fused product do), else a copy. No try/except
    around view: torch.compile traces this."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as F.silu(gate) * up computes it (to rounding)."""
    return SwiGLUFunction.apply(gate, up)


class TritonMLP(MLP):
    """The SwiGLU MLP with the fused product; fivefold.kernels.apply_kernels swaps a module's class to this
    one, so the module, its projections and the parameter names stay as they were."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(swiglu(*self.gate_and_up(x)))
        return super().forward(x)
