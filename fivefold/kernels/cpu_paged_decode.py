"""Decode attention over the paged KV pool on a CPU, reading keys and values in place (serve.cpu_kernel).

The CPU path otherwise gathers every decode's blocks into padded copies and runs SDPA over them: at 8-11
decodes of a few hundred tokens that was 18 ms of a 66 ms step on the 2-vCPU test host, 11 of them gathers,
stores and scatters (bench/serve_decode_breakdown.py). The kernel (cpu_paged_decode.cpp) walks each
sequence's block table instead, scoring a block's keys against every query head that reads them and folding
the block into an online softmax, so the pool is read once and nothing is copied.

It is C++ built at first use with torch's extension builder (a C++ compiler and ninja; ~40 s on 2 cores),
for this CPU's instruction set, where torch keeps its extensions ($TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), and loaded from there afterwards. Where it
cannot be built, `kernel_problem()` says why and the engine keeps gather + SDPA, which stays the reference
the kernel is tested against (tests/test_cpu_paged_decode.py). float32 only: the pool of a bf16 engine takes
the SDPA path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
HEAD_SIZES = (16, 32, 48, 64, 80, 96, 128, 256)  # the head sizes the source instantiates


def _cpu_signature() -> str:
    """What the built code depends on besides its source: it is compiled for this CPU (-march=native), so a
    cache directory shared by machines with other instruction sets must not hand them this build."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__}".encode()).hexdigest()[:10]


@functools.cache
def _build():
    """(module, None) once built and loaded, or (None, why not)."""
    from torch.utils.cpp_extension import load, verify_ninja_availability

    try:
        verify_ninja_availability()
    except RuntimeError:
        return None, "ninja is not installed (pip install ninja)"
    name = f"fivefold_cpu_paged_decode_{_cpu_signature()}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    build_dir = Path(root) / name  # torch's own place for extensions, shared by every run on this machine
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):  # on stderr: `fivefold generate` writes its text on stdout
        print(f"building the CPU paged-decode kernel for this machine (once; ~1 min on 2 cores) in {build_dir}",
              file=sys.stderr, flush=True)
    try:
        module = load(name=name, sources=[str(SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                      build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - whatever failed (no compiler, a linker error), the answer is the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"building it failed: {type(e).__name__}: {first}"[:300]
    return module, None


def kernel_problem() -> str | None:
    """Why the kernel cannot run here (building it on the first call), or None when it can."""
    return _build()[1]


def unsupported(head_size: int, dtype: torch.dtype) -> str | None:
    """Why a model of this head size and KV dtype cannot use the kernel, or None."""
    if dtype != torch.float32:
        return f"the KV pool is {str(dtype).removeprefix('torch.')} (the kernel reads float32)"
    if head_size not in HEAD_SIZES:
        return f"head size {head_size} is not one of {HEAD_SIZES}"
    return None


def decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for one query token per sequence over its paged context.

    q (B, H, d) float32, any row and head strides; k_blocks, v_blocks (blocks, block_size, Hkv, d) contiguous;
    block_tables int32 (B, max_blocks); seq_lens int32 (B,), each sequence's keys including its own token's,
    which must already be stored. -> (B, H, d); a row of length 0 is zeros. Query head h reads key/value head
    h // (H // Hkv)."""
    module, why = _build()
    if module is None:
        raise RuntimeError(f"the CPU paged-decode kernel is not available: {why}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    # Work items are sequences; with fewer sequences than threads, each key/value head is an item of its own.
    kv_heads = k_blocks.shape[2]
    splits = kv_heads if q.shape[0] < 2 * torch.get_num_threads() else 1
    return module.decode_attention(q, k_blocks, v_blocks, block_tables, seq_lens, q.shape[-1] ** -0.5, splits)
