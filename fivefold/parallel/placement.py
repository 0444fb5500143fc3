"""The placement record: for every parameter a rank holds, where its local tensor sits in the global one.

`parallelize` (fivefold.parallel.apply) builds it while it splits the model; everything that needs to
know how a parameter is laid out reads it from here instead of from attributes glued onto tensors:
materialisation (which slice of the initial value to make), ZeRO (the rows it shards further), the
gradient norm (which squares to sum over which group), checkpoints (global shape and offsets) and
export. ZeRO's dp rows are not part of it: they split the *local* tensor, and the ZeRO engine owns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    global_shape: tuple[int, ...]
    tp_axis: int | None = None  # split over the tensor-parallel group along this axis
    tp_rank: int = 0
    tp_size: int = 1
    expert: bool = False  # a routed expert's weight: only this expert-parallel rank holds it

    @property
    def tp_sharded(self) -> bool:
        return self.tp_axis is not None and self.tp_size > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.tp_sharded:
            shape[self.tp_axis] //= self.tp_size
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets = [0] * len(self.global_shape)
        if self.tp_sharded:
            offsets[self.tp_axis] = self.tp_rank * self.local_shape[self.tp_axis]
        return tuple(offsets)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global tensor `full` (a copy when it is a slice, so `full` can go)."""
        if not self.tp_sharded:
            return full
        size = self.local_shape[self.tp_axis]
        return full.narrow(self.tp_axis, self.tp_rank * size, size).clone()


Placements = dict[str, Placement]


def record(model: torch.nn.Module, tp_axes: dict[str, int], experts: set[str], tp_rank: int = 0,
           tp_size: int = 1) -> Placements:
    """The placement of each of `model`'s (local, possibly meta) parameters, by name: `tp_axes` names
    the tensor-parallel shards and their axes, `experts` the expert-parallel ones."""
    out = {}
    for name, p in model.named_parameters():
        axis = tp_axes.get(name)
        shape = list(p.shape)
        if axis is not None:
            shape[axis] *= tp_size
        out[name] = Placement(tuple(shape), axis, tp_rank, tp_size, name in experts)
    return out
