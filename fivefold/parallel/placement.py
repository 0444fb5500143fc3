"""The placement record: for every parameter a rank holds, where its local tensor sits in the global one.

`parallelize` (fivefold.train.parallelize) builds it while it splits the model; everything that needs to
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
    # A mixture of experts' stacked weight (E, out, in): the expert-parallel ranks split it along axis 0,
    # each holding its experts' matrices.
    expert: bool = False
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def tp_sharded(self) -> bool:
        return self.tp_axis is not None and self.tp_size > 1

    def _splits(self) -> list[tuple[int, int, int]]:
        """(axis, rank, size) of each split of the global tensor."""
        splits = [(self.tp_axis, self.tp_rank, self.tp_size)] if self.tp_sharded else []
        if self.expert and self.ep_size > 1:
            splits.append((0, self.ep_rank, self.ep_size))
        return splits

    @property
    def sharded(self) -> bool:
        """Whether this rank holds a part of the global tensor rather than all of it."""
        return bool(self._splits())

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        for axis, _, size in self._splits():
            shape[axis] //= size
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets, local = [0] * len(self.global_shape), self.local_shape
        for axis, rank, _ in self._splits():
            offsets[axis] = rank * local[axis]
        return tuple(offsets)

    @property
    def experts(self) -> range:
        """The experts (rows of axis 0) a stacked expert weight holds here."""
        return range(self.offsets[0], self.offsets[0] + self.local_shape[0])

    def per_expert(self) -> "Placement":
        """The placement of one expert's matrix of a stacked expert weight (its tensor-parallel split)."""
        axis = self.tp_axis - 1 if self.tp_axis is not None else None
        return Placement(self.global_shape[1:], axis, self.tp_rank, self.tp_size)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global tensor `full` (a copy when it is a slice, so `full` can go)."""
        if not self.sharded:
            return full
        for axis, offset, size in zip(range(full.dim()), self.offsets, self.local_shape):
            full = full.narrow(axis, offset, size)
        return full.clone()


Placements = dict[str, Placement]


def record(model: torch.nn.Module, tp_axes: dict[str, int], experts: set[str], tp_rank: int = 0,
           tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> Placements:
    """The placement of each of `model`'s (local, possibly meta) parameters, by name: `tp_axes` names
    the tensor-parallel shards and their axes, `experts` the expert-parallel ones (split along axis 0)."""
    out = {}
    for name, p in model.named_parameters():
        axis = tp_axes.get(name)
        shape = list(p.shape)
        if axis is not None:
            shape[axis] *= tp_size
        if name in experts:
            shape[0] *= ep_size
        out[name] = Placement(tuple(shape), axis, tp_rank, tp_size, name in experts, ep_rank, ep_size)
    return out
