"""Hooks that do not keep their owner alive.

A reducer registers its bound methods as hooks on the parameters and modules it holds: parameter ->
hook -> reducer -> parameter is a reference cycle, so a finished run's parameters, gradients and
optimizer states would stay allocated until the cycle collector happens to run (on a GPU, gigabytes
between two runs in one process). Registered through `weak`, the hook holds its owner weakly: dropping
the trainer frees everything at once.
"""

from __future__ import annotations

import weakref
from typing import Callable


def weak(method: Callable) -> Callable:
    """`method` (bound) as a function that holds its object weakly and does nothing once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call
