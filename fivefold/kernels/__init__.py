"""Fused Triton kernels for RMSNorm, the SwiGLU product and RoPE, applied to a built model from outside.

The model stays plain PyTorch (fivefold/model): these kernels are swapped in by `apply_kernels`, the
same way parallelism and recomputation are applied (fivefold.train.parallelize, fivefold.train.recompute),
and every module, parameter and parameter name stays as it was, so checkpoints, the name-seeded init and
the placement record see no difference. Each kernel is an autograd.Function with its forward and
backward side by side, and computes what the PyTorch path computes (to rounding).

Triton compiles for CUDA GPUs. On a CPU it can only interpret the kernels (TRITON_INTERPRET=1, set
before the kernels are imported): correct but very slow, which is what the tests use. Whether the
kernels pay on a given GPU is measured by bench/kernels.py against eager and torch.compile.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn

from fivefold.config import ConfigError
from fivefold.model.attention import Attention
from fivefold.model.layers import MLP, RMSNorm
from fivefold.model.moe import GroupedExperts

KERNELS = ("torch", "triton")


def _unavailable() -> str | None:
    """Why the Triton kernels cannot run in this process, or None when they can."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return "the triton package is not installed (pip install 'triton>=3.1'; Linux x86-64 wheels only)"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA GPU is available to compile them for"
    return None


def triton_available() -> bool:
    """Triton is importable, and there is a CUDA GPU to run it on or TRITON_INTERPRET=1 (tests)."""
    return _unavailable() is None


def check_usable(key: str = "train.kernels") -> None:
    """Raise a ConfigError saying what to do unless the Triton kernels can run in this process (checked
    again before any process group starts: fivefold.parallel.mesh.check_supported)."""
    if not triton_available():
        raise ConfigError(f"{key}=triton cannot run here: {_unavailable() or 'Triton is not usable'}; "
                          f"install triton and run on a CUDA GPU, use {key}=torch, or (for tests only) "
                          f"set TRITON_INTERPRET=1 to run the kernels in Triton's slow CPU interpreter")


def apply_kernels(model: nn.Module, kernels: str) -> None:
    """Run `model`'s RMSNorms, SwiGLU MLPs (dense and experts) and RoPE with the Triton kernels
    (kernels="triton"), or leave it as it is ("torch"). Norms and MLPs change class to a subclass whose
    forward calls the kernel; attention's `rope_fn` becomes the Triton RoPE, the stacked experts'
    `swiglu_fn` the fused product. In place; call it on the
    (meta or materialised) model before torch.compile."""
    if kernels not in KERNELS:
        raise ConfigError(f"train.kernels={kernels!r} is not valid; choose one of {', '.join(KERNELS)}")
    if kernels == "torch":
        return
    check_usable()
    from fivefold.kernels.rmsnorm import TritonRMSNorm  # imports triton: only once it is known to work
    from fivefold.kernels.rope import apply_rope
    from fivefold.kernels.swiglu import TritonMLP, swiglu

    for module in model.modules():
        # Exact types: a module already swapped, or another subclass (e.g. a future adapter), is left alone.
        if type(module) is RMSNorm:
            module.__class__ = TritonRMSNorm
        elif type(module) is MLP and module.swiglu:
            module.__class__ = TritonMLP
        elif isinstance(module, Attention) and module.use_rope:
            module.rope_fn = apply_rope
        elif isinstance(module, GroupedExperts):
            module.swiglu_fn = swiglu
