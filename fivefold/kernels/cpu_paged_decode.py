"""Decode attention over the paged KV pool on a CPU, reading keys and values in place (serve.cpu_kernel).

The CPU path otherwise gathers every decode's blocks into padded copies and runs SDPA over them: at 8-11
decodes of a few hundred tokens that was 18 ms of a 66 ms step on the 2-vCPU test host, 11 of them gathers,
stores and scatters (bench/serve_decode_breakdown.py). The kernel (cpu_paged_decode.cpp) walks each
sequence's block table instead, scoring a block's keys against every query head that reads them and folding
the block into an online softmax, so the pool is read once and nothing is copied.

It is C++ built at first use with the other CPU kernels (fivefold.kernels.cpu_build: once per machine, ~1
min on 2 cores). Where it cannot be built, `kernel_problem()` says why and the engine keeps gather + SDPA,
which stays the reference the kernel is tested against (tests/test_cpu_paged_decode.py). The pool is float32 or
bfloat16 (a bfloat16 engine's): bfloat16 keys and values are widened to float32 as they are read, the queries
widened before and the output rounded to bfloat16 once after, all arithmetic float32. Where the CPU multiplies
bfloat16 pairs (AVX512_BF16: `pairs()`), the bfloat16 queries score the bfloat16 keys as pairs instead: each product
still exact, the sums float32 in another order, and subnormal values read as zero.
"""

from __future__ import annotations

import torch

from fivefold.kernels import cpu_build

HEAD_SIZES = (16, 32, 48, 64, 80, 96, 128, 256)  # the head sizes the source instantiates


def _build():
    """(module, None), or (None, why not): the CPU kernels' build (fivefold.kernels.cpu_build)."""
    return cpu_build.build()


def kernel_problem() -> str | None:
    """Why the kernel cannot run here (building it on the first call), or None when it can."""
    return _build()[1]


def unsupported(head_size: int, dtype: torch.dtype) -> str | None:
    """Why a model of this head size and KV dtype cannot use the kernel, or None."""
    if dtype not in cpu_build.DTYPES:
        return f"the KV pool is {str(dtype).removeprefix('torch.')} (the kernel reads float32 and bfloat16)"
    if head_size not in HEAD_SIZES:
        return f"head size {head_size} is not one of {HEAD_SIZES}"
    return None


def pairs() -> bool:
    """Whether bfloat16 queries score bfloat16 keys as bfloat16 pairs here (AVX512_BF16)."""
    module = _build()[0]
    return module is not None and module.bf16_pairs()


def decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, portable: bool = False, widened: bool = False,
                     owners: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for one query token per sequence over its paged context.

    q (B, H, d) float32 or bfloat16 (the pool's dtype), any row and head strides; k_blocks, v_blocks (blocks,
    block_size, Hkv, d) contiguous;
    block_tables int32 (B, max_blocks); seq_lens int32 (B,), each sequence's keys including its own token's,
    which must already be stored. `owners` int32 (B,), where given: the row of block_tables each query row reads
    (a prompt chunk's tokens, attending as rows of their own, share their sequence's table). -> (B, H, d); a row of length 0 is zeros. Query head h reads key/value head
    h // (H // Hkv). `portable` scores the keys in the form built for CPUs without AVX-512 (one dot product a
    key; elsewhere it is the only form), and `widened` scores bfloat16 queries and keys as a CPU without
    AVX512_BF16 does, so that a test on an AVX-512 machine covers those forms too."""
    module, why = _build()
    if module is None:
        raise RuntimeError(f"the CPU paged-decode kernel is not available: {why}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return module.decode_attention(q, k_blocks, v_blocks, block_tables, seq_lens, q.shape[-1] ** -0.5,
                                   decode_splits(q.shape[0], k_blocks.shape[2]), portable, widened, owners)


def decode_splits(rows: int, kv_heads: int) -> int:
    """The kernel's work items per sequence: with fewer sequences than threads, each key/value head is an item
    of its own."""
    return kv_heads if rows < 2 * torch.get_num_threads() else 1
