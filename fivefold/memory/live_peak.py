"""The peak of the tensor memory a piece of code allocates, measured op by op on any device.

A TorchDispatchMode sees every op's outputs. A storage that is none of the op's inputs' (not a view, not an
in-place or `out=` write into a buffer that already existed) is new: its bytes count as live until a weak
reference says it was freed. `peak` is the most that was live at once after any op, so it leaves out what
existed before (weights, a KV pool, persistent buffers) and counts what the code itself holds. On a CPU,
where no allocator keeps a count, this is the measurement; on CUDA it agrees with the caching allocator's
`max_memory_allocated` less what was allocated before, up to kernels' internal workspaces, which no op returns.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LivePeak(TorchDispatchMode):
    """`with LivePeak() as m: ...`, then `m.peak` (bytes) and `m.at_peak`: (op, shape, bytes) of each storage
    live at that moment, largest first (what to shrink)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages = WeakIdKeyDictionary()  # storage -> (op, shape, bytes, weakref)
        self.at_peak: list[tuple[str, tuple, int]] = []

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (to measure one phase of a region)."""
        self.peak = self.live

    def _freed(self, nbytes: int, ref) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        grew = False
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.data_ptr() in inputs or st in self._storages:
                continue
            nbytes = st.nbytes()
            self.live += nbytes
            self._storages[st] = (func.__name__, tuple(t.shape), nbytes, weakref.ref(st, partial(self._freed, nbytes)))
            grew = True
        if grew and self.live > self.peak:
            self.peak = self.live
            self.at_peak = sorted((entry[:3] for entry in self._storages.values()), key=lambda e: -e[2])
        return out
