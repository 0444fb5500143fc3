"""A served model's weights and KV pool in transparent huge pages, on a CPU (serve.huge_pages).

A decode step streams every weight from memory once. With 4 KiB pages that is a TLB miss every 4 KiB
(135k page walks for `smollm2-135m`'s 538 MB a token); with 2 MiB pages, 256 a token. Linux backs memory
with huge pages where asked (`madvise(MADV_HUGEPAGE)`) when transparent huge pages are set to `madvise`
(the usual default) or `always`; torch's CPU allocator asks only when THP_MEM_ALLOC_ENABLE is set before
its first allocation, which a library cannot arrange for its caller. So here the weights move, once, into
one anonymous mapping advised for huge pages: each storage copied in and every tensor that views it
(parameters, fused products' weights, their parts) re-pointed, one storage at a time, so the process holds
at most one storage twice. The bytes, layouts, strides and values are unchanged (each storage starts on a
page boundary, as torch's allocator places it), so the logits are the same bit for bit (tested). Measured
against 4 KiB pages in one process by `bench/serve_cpu_ab.py --compare huge-pages`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each storage on a page of its own, so kernels see the alignment torch's allocator gives
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this kernel backs memory advised MADV_HUGEPAGE with huge pages (its setting is `always` or
    `madvise`, not `never`), and Python can advise it."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zeroed bytes (uint8) starting on a huge-page boundary, in private anonymous memory advised
    for huge pages. Pages are committed as they are written, like any anonymous memory."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


@functools.cache
def _libc():
    """The C library, found once (find_library searches the system's library cache each call)."""
    return ctypes.CDLL(ctypes.util.find_library("c"))


def _trim_heap() -> None:
    """Return the free memory at the top of glibc's heaps to the system (malloc_trim): storages the engine
    made at start-up (the fused weights) live there, and freeing them alone would not lower the resident set."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: the allocator keeps what it keeps


def _tensors(model: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(module, attribute, is a parameter) for every tensor the served model reads its weights through:
    parameters, buffers (a quantized linear's codes and scales) and tensors set as plain attributes (a fused
    product's weight and bias)."""
    found = []
    # The modules, and those held as plain attributes (a fused quantized product, fivefold.serve.fused).
    held = [v for m in model.modules() for v in vars(m).values() if isinstance(v, nn.Module)]
    for module in [*model.modules(), *held]:
        found += [(module, name, True) for name, p in module._parameters.items() if p is not None]
        found += [(module, name, False) for name, b in module._buffers.items() if b is not None]
        found += [(module, name, False) for name, value in vars(module).items()
                  if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)]
    return found


def move_to_huge_pages(model: nn.Module) -> int:
    """Move every CPU storage `model` reads its weights from (parameters, buffers, fused weights) into one
    mapping advised for huge pages, in place; the bytes moved (0 when an earlier call moved them all)."""
    arenas = model.__dict__.setdefault("_huge_page_arenas", set())  # storages earlier calls made
    views = defaultdict(list)  # storage address -> the (module, name, is a parameter) that view it
    sizes = {}
    for module, name, is_param in _tensors(model):
        tensor = getattr(module, name)
        if tensor.layout != torch.strided or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in arenas:
            views[storage.data_ptr()].append((module, name, is_param))
            sizes[storage.data_ptr()] = storage.nbytes()
    if not sizes:
        return 0
    arena = huge_page_bytes(sum(-(-n // ALIGN) * ALIGN for n in sizes.values()))
    storage, offset = arena.untyped_storage(), arena.storage_offset()
    with torch.no_grad():
        for ptr, nbytes in sizes.items():  # one storage at a time: the old one is freed before the next
            module, name, _ = views[ptr][0]
            old = torch.empty(0, dtype=torch.uint8).set_(getattr(module, name).untyped_storage())
            torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,)).copy_(old)
            del old
            for module, name, is_param in views[ptr]:
                tensor = getattr(module, name)
                if tensor.untyped_storage().data_ptr() != ptr:  # a tied parameter, re-pointed already
                    continue
                new = torch.empty(0, dtype=tensor.dtype).set_(
                    storage, offset // tensor.element_size() + tensor.storage_offset(), tensor.shape, tensor.stride())
                if is_param:
                    tensor.data = new
                else:
                    setattr(module, name, new)
            offset += -(-nbytes // ALIGN) * ALIGN
            _trim_heap()  # the old storage, freed into glibc's heap, goes back to the system before the next copy
    arenas.add(storage.data_ptr())
    return sum(sizes.values())
