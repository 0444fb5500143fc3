"""Whether forward hooks sit on a module: the serving paths that do a module's work without calling it (the lean
loop, the fused residual loop, the CPU kernel's prompt rows) step aside for one that has them, so that the hooks run."""

from __future__ import annotations

from torch import nn


def hooked(module) -> bool:
    """A module with forward or forward-pre hooks of its own (anything else, e.g. a bound forward: False)."""
    return isinstance(module, nn.Module) and bool(module._forward_hooks or module._forward_pre_hooks)
