"""A linear's product at a decode's few rows on a CPU, reading each weight once (serve.cpu_kernel).

MKL's and oneDNN's float32 products stream a weight at close to the memory's speed at one row, but at 4-16
rows (the decode steps of a few sequences) they read it at a third to a half of that on the 2-vCPU Intel
host: the step pays for its rows as if each re-read the weights. cpu_linear_rows.cpp multiplies each tile of
four weight rows against every input row while the tile is in the first-level cache, and prefetches the next
tile while it works. fivefold.serve.cpu_linear times it against the libraries for each weight shape and keeps
it where it is faster (serve.linear=auto). Past `max_rows()` (32 with AVX-512, 16 with AVX2; prompt chunks) it
hands over to F.linear; below MIN_ROWS rows (a batch-1 decode) the timing chooses between the kernel itself and
a library's one-row product, F.linear's or oneDNN's.

Each output is one dot product summed in a fixed order, so a row's result does not depend on the other rows
or the thread count (tested); it equals F.linear to float32 rounding, not bit for bit. Its weights are float32
or bfloat16 (a bfloat16 engine's): bfloat16 weights are read as they are, half the bytes, multiplied exactly and
summed in float32, and the output is rounded to bfloat16 once (after a bias joins the sums), as the libraries'
bfloat16 products do. Where the CPU has AVX512_BF16 (AMD Zen 4, Intel Cooper Lake and Sapphire Rapids) one
instruction multiplies bfloat16 rows and weights in pairs; elsewhere the weights are widened to float32 as loaded
and the rows before. `python bench/cpu_linear_rows.py --dtype bfloat16`, smollm2-135m's shapes on the 2-vCPU AMD
host (Zen 4): the pairs 1.04-2.2x the best library at every row count 1-32, and 1.5-2x the widening form at 16-32
rows, where that form had fallen to 0.57-0.90x the libraries. It runs on a CPU with AVX-512 (tiles of 4 x 4 in
16 lanes) or AVX2 with FMA (4 x 3 in 8 lanes, as most laptops have; an AVX-512 build has both, and the tests run
both); elsewhere `rows_kernel_problem()` says why and the libraries' products run. Where it runs, the per-shape
timing keeps it only where it is faster.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fivefold.kernels import cpu_build
from fivefold.kernels.cpu_build import DTYPES

# The rows the kernel takes. Below MIN_ROWS a library's one-row product may be as fast or faster: on the
# Intel host MKL's sgemv (at 1-3 rows the kernel's was 0.76-1.15x it on smollm2-135m's shapes, at 4 rows
# 1.2-2.0x), though not on the AMD host (there the kernel read one row at 25-28 GB/s, oneDNN 13-19, MKL 8-14),
# so whether the kernel takes them too is timed per shape (fivefold.serve.cpu_linear); beyond the tiles' most
# rows the libraries' blocked products are: with AVX-512 past 32 (at 64 rows MKL's was 1.1-1.5x the kernel's,
# at 32 the kernel's 1.1-1.4x MKL's), with AVX2 past 16 (its tiles ran 0.55-0.78x MKL's at 24-32 rows and
# 0.93-1.27x at 16 on the Intel host, bench/cpu_linear_rows.py --width 256).
MIN_ROWS, MAX_ROWS_BY_WIDTH = 4, {512: 32, 256: 16}


_limit: list[int] = []  # max_rows(), once known: a plain value a compiled graph reads (serve.compile_decode)


def max_rows() -> int:
    """The most rows this machine's build of the kernel takes (0 where it has none). Known once the engine has
    asked rows_kernel_problem(), before anything compiles."""
    if not _limit:
        module = cpu_build.build()[0]
        _limit.append(MAX_ROWS_BY_WIDTH.get(module.linear_rows_width(), 0) if module is not None else 0)
    return _limit[0]


_LIB = torch.library.Library("fivefold", "FRAGMENT")
_LIB.define("cpu_linear_rows(Tensor x, Tensor w, Tensor? bias=None) -> Tensor")
_LIB.impl("cpu_linear_rows", lambda x, w, bias=None: cpu_build.build()[0].linear_rows(x, w, 0, bias), "CPU")
torch.library.register_fake("fivefold::cpu_linear_rows", lambda x, w, bias=None: x.new_empty(x.shape[0], w.shape[0]),
                            lib=_LIB)


def rows_kernel_problem() -> str | None:
    """Why the rows kernel cannot run here (building the CPU kernels on the first call), or None."""
    module, why = cpu_build.build()
    if why:
        return why
    max_rows()
    return None if module.linear_rows_width() else "this CPU has neither AVX-512 nor AVX2 with FMA"


def offered(cpu_kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether serve.cpu_kernel=`cpu_kernel` puts the rows kernel among the products a `dtype` engine on
    `device` chooses from (the engine and the serving calibration alike): float32 or bfloat16 on a CPU where it
    runs."""
    return cpu_kernel != "false" and device.type == "cpu" and dtype in DTYPES and rows_kernel_problem() is None


def product_at(rows: int, weight: torch.Tensor, few_rows: Callable | None) -> Callable | None:
    """What `linear_rows` runs for `rows` rows of the weight's dtype over `weight`: None for the rows kernel itself,
    else the product it hands them to (F.linear, or `few_rows` below MIN_ROWS). fivefold.serve.cpu_linear.cpp_product
    asks it too, so that C++ runs the product the loop would."""
    if not 0 < rows <= max_rows() or weight.dtype not in DTYPES or weight.dim() != 2 or weight.stride(1) != 1:
        return F.linear
    if rows < MIN_ROWS and few_rows is not None:
        return few_rows
    return None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                few_rows: Callable | None = F.linear) -> torch.Tensor:
    """F.linear(x, weight, bias): through the rows kernel for MIN_ROWS..max_rows() rows of float32 or bfloat16
    (x and the weight alike) with the weight in its (out, in) layout, and below MIN_ROWS through `few_rows` (a
    library's product: which one streams one row fastest depends on the CPU), or the kernel too where it is
    None; else F.linear. No autograd: gradients take F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (x.dtype not in DTYPES or x.dtype != weight.dtype or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    other = product_at(rows, weight, few_rows)
    if other is not None:
        return other(x, weight, bias)
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    # A bias joins the float32 sums, before a bfloat16 product's one rounding.
    if torch.compiler.is_compiling():  # an op a compiled graph keeps whole (serve.compile_decode)
        y = torch.ops.fivefold.cpu_linear_rows(x2, weight, bias)
    else:  # the module's own call: the dispatcher's costs a few microseconds a product
        y = cpu_build.build()[0].linear_rows(x2, weight, 0, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
