"""A decode block's small ops on a CPU as one call each (serve.cpu_kernel; cpu_block_ops.cpp).

At a batch-1 decode, the torch path's RMSNorm (F.rms_norm: ~8 ops), RoPE, slicing, the KV store and SwiGLU cost their
per-call overhead, not their bytes: ~4 ms of a 24 ms smollm2-135m token on the 2-vCPU test host
(bench/serve_decode_breakdown.py). These do the same work in one call each:

- `rms_norm_rows`: RMSNorm of each row; `add_rms_norm_rows`: the residual add and the norm after it. Equal to
  F.rms_norm to float32 rounding (the sum of squares is summed in another order), not bit for bit.
- `silu_mul_rows`: SwiGLU's silu(gate) * up from the fused gate/up product (its chunk, silu and product), to a
  few ulp of torch's (another exp).
- `rotary_decode_attention`: from the fused q/k/v product of a decode-only step, RoPE on queries and keys, the
  store of keys and values in their slots, and fivefold.kernels.cpu_paged_decode's attention. The stored keys
  equal the torch path's bit for bit (each product and the sum rounded on its own, as torch's ops do).
- `decode_blocks`: every block of a decode-only step as one call, where each block's four products run on the
  rows kernel (fivefold.kernels.cpu_linear_rows) or torch's linear: the lean loop's calls above in its order,
  so equal to the loop calling them one by one bit for bit, without its Python and dispatch between them
  (+11% at batch 1 on smollm2-135m, bench/serve_cpu_ab.py --compare one-call).

Each takes float32 or bfloat16 (a bfloat16 engine's: rounded where RMSNorm.forward's cast and torch's bfloat16 ops
round, the arithmetic between in float32: the norms and SwiGLU within a bfloat16 step of the torch path's and
mostly equal, the rotated keys stored bit for bit). Built with the other CPU kernels (fivefold.kernels.cpu_build). The lean loop
(fivefold.serve.lean_forward) calls them on the engine's CPU path where serve.cpu_kernel is on.
"""

from __future__ import annotations

import torch

from fivefold.kernels import cpu_build
from fivefold.kernels.cpu_paged_decode import decode_splits


def _module():
    module, why = cpu_build.build()
    if module is None:
        raise RuntimeError(f"the CPU block kernels are not available: {why}")
    return module


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, h) float32 or bfloat16 -> each row's RMSNorm with `weight` (h,, x's dtype)."""
    return _module().rms_norm_rows(x.contiguous(), weight, eps)


def add_rms_norm_rows(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) for x and delta (T, h) float32 or bfloat16."""
    total, normed = _module().add_rms_norm_rows(x.contiguous(), delta.contiguous(), weight, eps)
    return total, normed


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2F) float32 or bfloat16, gate then up -> silu(gate) * up (T, F)."""
    return _module().silu_mul_rows(gate_up.contiguous())


def rotary_decode_attention(heads: torch.Tensor, q_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                            k_blocks: torch.Tensor, v_blocks: torch.Tensor, slots: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """A decode-only step's attention from its fused q/k/v product.

    heads (T, q_heads + 2 Hkv, d): queries, keys, values, not yet rotated; cos and
    signed_sin (T, d) contiguous, the rotation x * cos + roll(x, d / 2) * signed_sin (fivefold.serve.lean_forward's
    form of apply_rope); k_blocks, v_blocks (blocks, block_size, Hkv, d) contiguous; slots int32 (T,), each
    row's slot in the pool (< 0: a padding row, stored nowhere); block_tables int32 (T, max_blocks), seq_lens
    int32 (T,) including this token. Rotates, stores keys and values, attends -> (T, q_heads, d)."""
    if heads.stride(-1) != 1:  # a quantized product's output may come transposed
        heads = heads.contiguous()
    splits = decode_splits(heads.shape[0], k_blocks.shape[2])
    return _module().rotary_decode_attention(heads, q_heads, cos, signed_sin, k_blocks, v_blocks, slots, block_tables,
                                             seq_lens, heads.shape[-1] ** -0.5, splits, portable)


def decode_blocks(x: torch.Tensor, params: list[torch.Tensor], eps: list[float], products: list[int], q_heads: int,
                  cos: torch.Tensor, signed_sin: torch.Tensor, k_blocks: list[torch.Tensor],
                  v_blocks: list[torch.Tensor], slots: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> torch.Tensor:
    """The blocks of a decode-only step over x (T, h) float32: per layer 7 `params` (attention norm weight, q/k/v
    weight, its bias or an empty tensor, o weight, MLP norm weight, gate/up weight, down weight; (out, in)), 2
    `eps` (the norms') and 4 `products` (q/k/v, o, gate/up, down: fivefold.serve.cpu_linear.ROWS_KERNEL, whose
    weight needs unit stride along in, or TORCH_LINEAR); each layer's pools as `rotary_decode_attention` takes
    them, and its other arguments. -> x after the last block."""
    splits = decode_splits(x.shape[0], k_blocks[0].shape[2])
    return _module().decode_blocks(x.contiguous(), params, eps, products, q_heads, cos, signed_sin, k_blocks, v_blocks,
                                   slots, block_tables, seq_lens, k_blocks[0].shape[-1] ** -0.5, splits)
