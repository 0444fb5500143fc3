"""Subclasses that a module's class is swapped for from outside (fused projections, float8 casts), one per
(class, prefix): the same class each time, so instances of one kind share it and torch.compile sees one."""

from __future__ import annotations

from typing import Callable

_MADE: dict[tuple[type, str], type] = {}


def derived_class(cls: type, prefix: str, namespace: Callable[[], dict]) -> type:
    """`cls`'s subclass named `prefix` + its name, with the attributes `namespace()` returns (called only when
    the subclass is first made, e.g. to import an optional dependency late)."""
    key = (cls, prefix)
    if key not in _MADE:
        _MADE[key] = type(prefix + cls.__name__, (cls,), namespace())
    return _MADE[key]
