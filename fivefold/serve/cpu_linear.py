"""The serving model's linears on a CPU: for each weight shape, the faster of torch's two CPU products in
the faster layout, timed once per machine (serve.linear).

torch has two products a CPU linear can run on, and which one streams a decode's weights faster depends on
the CPU: F.linear (MKL's sgemv / sgemm on an x86 wheel) and oneDNN's inner product
(`mkldnn._linear_pointwise`, the op torch.compile's CPU backend emits for a linear). On the project's
2-vCPU AMD EPYC host MKL read the weights on one thread at one row, 17 GB/s where a sum over the same
tensors read 45-48, and oneDNN 24-37 GB/s; on its 2-vCPU Intel Xeon host the order reversed: over
`smollm2-135m`'s block products at one row MKL took 17.4 ms a token and oneDNN 25.0 (each in its better
layout), and oneDNN's call cost 32 us against F.linear's 4 (bench/serve_decode_breakdown.py).

A weight may also be laid out input-major (the same (out, in) parameter, stored as the transpose of an
(in, out) contiguous tensor), which each product runs faster or slower depending on the shape and the
machine: on the AMD host oneDNN ran `smollm2-135m`'s 576-wide products 10-70% faster so at 1-32 rows and a
2048 x 2048 one 20-40% slower; on the Intel host MKL ran them 0-38% faster at 4 and 16 rows.

So each distinct shape's candidates (each product in each layout) are timed once per machine
(`chosen_product`), alternately over copies of random weights larger than a cache, and the fastest kept in
the cache directory, so that every start of a server sums in the same order. The LM head keeps its layout:
it is the embedding too where they are tied, whose lookups read rows. Nothing is held twice (each weight
is re-laid one at a time), names and shapes are unchanged, and `Engine.update_weights` still copies into
the same parameters; this is a choice of kernel and layout only: the same product, summed in another order.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.data.corpus import cache_dir
from fivefold.kernels.cpu_linear_rows import DTYPES as ROWS_DTYPES
from fivefold.kernels.cpu_linear_rows import linear_rows, product_at
from fivefold.quant.linear import QuantLinear
from fivefold.serve.fused import FusedAttention


def onednn_available() -> bool:
    """torch was built with oneDNN and has the inner-product op (every x86 and aarch64 CPU wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_problem(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot multiply `dtype` here (no oneDNN in this torch; float16 on a CPU without AVX-512 FP16
    or AMX, where it cannot create the primitive), or None."""
    if not onednn_available():
        return "this torch has no oneDNN"
    try:
        onednn_linear(torch.ones(1, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype))
    except RuntimeError:
        return f"oneDNN has no {str(dtype).removeprefix('torch.')} product on this CPU"
    return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on oneDNN: x (..., in), weight (out, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def rows_kernel_all(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fivefold's rows kernel at every row count from one to its most, F.linear's product past them."""
    return linear_rows(x, weight, bias, few_rows=None)


def rows_kernel_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fivefold's rows kernel at 4 rows to its most, oneDNN's product below, F.linear's past them."""
    return linear_rows(x, weight, bias, few_rows=onednn_linear)


# The products a CPU linear can run on, by the name a choice is kept under; looked up at each use, so that
# the tests can stand in for them. The rows kernel (fivefold.kernels.cpu_linear_rows, serve.cpu_kernel) comes
# in three forms that differ in who runs one to three rows (a batch-1 decode; each hands prompt chunks past
# its most rows to F.linear): "rows kernel" the kernel itself, "rows kernel+F.linear" MKL's sgemv (on par on
# the Intel host), "rows kernel+oneDNN" oneDNN's (on the AMD host, where MKL streamed one row at 8-14 GB/s,
# oneDNN at 13-19 and the kernel at 25-28). All three read the weight in its (out, in) layout only.
LIBRARIES: dict[str, Callable] = {"oneDNN": onednn_linear, "F.linear": F.linear, "rows kernel": rows_kernel_all,
                                  "rows kernel+F.linear": linear_rows, "rows kernel+oneDNN": rows_kernel_onednn}


# The rows kernel's forms (values of LIBRARIES) and the product each hands one to three rows to (None: itself).
ROWS_KERNEL_FORMS = {rows_kernel_all: None, linear_rows: F.linear, rows_kernel_onednn: onednn_linear}
# How fivefold.kernels.cpu_block_ops.decode_blocks runs a product: the rows kernel, or torch's linear (F.linear's op).
ROWS_KERNEL, TORCH_LINEAR = 0, 1


def cpp_product(fn: Callable, rows: int, weight: torch.Tensor) -> int | None:
    """The product a linear whose product is `fn` (a value of LIBRARIES) runs at `rows` rows of float32 over
    `weight`, as C++ can call it in its place (fivefold.kernels.cpu_block_ops.decode_blocks): ROWS_KERNEL or
    TORCH_LINEAR, by the rows kernel's own rule (fivefold.kernels.cpu_linear_rows.product_at); None for oneDNN's,
    which C++ does not call."""
    if fn is F.linear:
        return TORCH_LINEAR
    if fn not in ROWS_KERNEL_FORMS:
        return None
    other = product_at(rows, weight, ROWS_KERNEL_FORMS[fn])
    return ROWS_KERNEL if other is None else TORCH_LINEAR if other is F.linear else None


def compiles(fn: Callable) -> bool:
    """Whether inductor can compile a linear whose product is `fn` (a value of LIBRARIES): F.linear's, or the rows
    kernel with F.linear's products beside it (a registered op inside a graph); oneDNN's op fails its lowering."""
    return fn is F.linear or fn is rows_kernel_all or fn is linear_rows


@dataclass(frozen=True)
class Product:
    """A linear's product on a CPU: which library, over which weight layout."""
    library: str  # a key of LIBRARIES
    input_major: bool = False

    @property
    def fn(self) -> Callable:
        return LIBRARIES[self.library]

    def __str__(self) -> str:
        return f"{self.library} {'input-major' if self.input_major else 'plain'}"

    @classmethod
    def parse(cls, text: object) -> Product | None:
        """The Product `str()` wrote, or None for anything else (a damaged or older cache entry)."""
        if not isinstance(text, str) or " " not in text:
            return None
        library, layout = text.rsplit(" ", 1)
        if library not in LIBRARIES or layout not in ("plain", "input-major"):
            return None
        return cls(library, layout == "input-major")


class RoutedLinear(nn.Linear):
    """An nn.Linear whose product is the one chosen for its shape; parameters, names and hooks (LoRA adapters)
    unchanged."""
    linear_fn = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values stored as the transpose of a contiguous (in, out) tensor."""
    return weight.detach().t().contiguous().t()


def is_input_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride()[0] == 1


# Decode sizes a product is chosen at; the bytes of weights it is timed over (beyond a server CPU's last-level
# cache, as a served model's weights are); and the smallest weight whose layout is worth timing (below it a
# product is its call's cost, whatever the layout, and only the library is chosen). The sizes between 1 and
# 16 count: on the Intel host MKL's product over the LM head's plain (out, in) weight took 4.3 ms at 1 row
# and 8.8 at 16, on par with oneDNN, but 10-22 ms at 4-14 rows, where oneDNN's took 7-9. 32 counts since
# the rows kernel takes up to 32 rows, about on par with the libraries there.
LAYOUT_ROWS, LAYOUT_BYTES, LAYOUT_MIN_BYTES = (1, 4, 8, 16, 32), 96 * 2**20, 2**20
PRODUCTS_FILE = "cpu_products.json"  # in the cache directory (fivefold.data.corpus.cache_dir)
_chosen: dict[str, Product] = {}


def _machine() -> str:
    """What a choice holds for: this CPU model, the thread count and torch's version."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _saved() -> dict[str, dict[str, str]]:
    try:
        data = json.loads((cache_dir() / PRODUCTS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: time again
        return {}


def _save(key: str, choice: Product) -> None:
    data = _saved()
    data.setdefault(_machine(), {})[key] = str(choice)
    path = cache_dir() / PRODUCTS_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def candidates(mode: str, layouts: bool, rows_kernel: bool = False) -> list[Product]:
    """The products serve.linear=`mode` chooses among on this CPU: "auto" both libraries (oneDNN where this
    torch has it), "onednn" oneDNN only; each in both layouts where `layouts`, else plain. With `rows_kernel`
    (it runs here, and serve.cpu_kernel allows it), "auto" adds fivefold's rows kernel in its three forms, in
    the plain layout."""
    libraries = ["oneDNN", "F.linear"] if mode == "auto" else ["oneDNN"]
    if not onednn_available():
        libraries.remove("oneDNN")
    options = [Product(lib, major) for lib in libraries for major in ((False, True) if layouts else (False,))]
    if rows_kernel and mode == "auto":
        options += [Product("rows kernel")] + [Product(f"rows kernel+{lib}") for lib in libraries]
    return options


def _nbytes(shape: tuple[int, int], dtype: torch.dtype) -> int:
    return shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()


def _time_products(shape: tuple[int, int], dtype: torch.dtype, options: list[Product]) -> dict[Product, float]:
    """Each product's time over copies of random `shape` weights at each of LAYOUT_ROWS rows, against the
    fastest product's at that many rows, summed over the row counts (so that one row counts as much as
    sixteen, whose products take longer); the best of 3 rounds that take the products in turn (so that a
    change in the host's speed falls on all of them). A product that cannot run `dtype` here is left out."""
    out, inp = shape
    plain = [torch.randn(out, inp).to(dtype) for _ in range(min(64, -(-LAYOUT_BYTES // _nbytes(shape, dtype))))]
    laid = {False: plain, True: [input_major(w) for w in plain] if any(p.input_major for p in options) else []}
    xs = [torch.randn(m, inp).to(dtype) for m in LAYOUT_ROWS]
    runs = []
    for p in options:  # warm up each (a library's first call sets up its kernels)
        try:
            for x in xs:
                p.fn(x, laid[p.input_major][0])
        except RuntimeError:  # a library without this dtype on this CPU: oneDNN's float16 without AVX-512 FP16
            continue
        runs.append(p)
    options = runs
    seconds = {(p, i): float("inf") for p in options for i in range(len(xs))}
    for _ in range(3):
        for p in options:
            for i, x in enumerate(xs):
                start = time.perf_counter()
                for w in laid[p.input_major]:
                    p.fn(x, w)
                seconds[p, i] = min(seconds[p, i], time.perf_counter() - start)
    best = [min(seconds[p, i] for p in options) for i in range(len(xs))]
    return {p: sum(seconds[p, i] / best[i] for i in range(len(xs))) for p in options}


def chosen_product(shape: tuple[int, int], dtype: torch.dtype, mode: str = "auto", layouts: bool = True,
                   rows_kernel: bool = False) -> Product:
    """The fastest of `candidates(mode, layouts, rows_kernel)` for (out, in) = `shape` weights (only the library below
    LAYOUT_MIN_BYTES). Timed once per machine and shape, on random weights, and kept in the cache directory:
    each product sums in its own order, so a close call that fell one way at one start and the other way at
    the next would change the last bits of the logits between two starts of a server."""
    out, inp = shape
    layouts = layouts and _nbytes(shape, dtype) >= LAYOUT_MIN_BYTES
    options = candidates(mode, layouts, rows_kernel)
    if len(options) == 1:
        return options[0]
    # The candidates and row counts are part of the key: a choice timed among others or at other sizes is
    # timed again.
    key = (f"{out}x{inp} {str(dtype).removeprefix('torch.')} {mode}: {', '.join(map(str, options))}"
           f" at rows {','.join(map(str, LAYOUT_ROWS))}")
    if key not in _chosen:
        saved = Product.parse(_saved().get(_machine(), {}).get(key))
        if saved in options:
            _chosen[key] = saved
        else:
            slowdown = _time_products((out, inp), dtype, options)
            _chosen[key] = min(slowdown, key=slowdown.__getitem__)
            try:
                _save(key, _chosen[key])
            except OSError:  # a read-only cache: the choice holds for this process, and is timed again next start
                pass
    return _chosen[key]


Chooser = Callable[[tuple[int, int], torch.dtype, bool], Product]


def laid_out(weight: torch.Tensor, major: bool) -> torch.Tensor:
    """The same values, input-major or in the plain (out, in) layout."""
    return input_major(weight) if major else weight.detach().contiguous()


def _relay(module: nn.Module, fused: str, parts: tuple[str, ...], major: bool) -> None:
    """Re-lay a fused weight (input-major or plain) and re-point its parts' parameters at their rows of it."""
    weight = laid_out(getattr(module, fused), major)
    setattr(module, fused, weight)
    start = 0
    for name in parts:
        linear = getattr(module, name)
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start:start + rows]
        start += rows


def route_linears(model: nn.Module, mode: str = "auto", choose: Chooser | None = None,
                  rows_kernel: bool = False) -> Counter:
    """Route every plain linear of `model` (on a CPU, in float32 or bfloat16), its fused q/k/v and gate/up
    products and its quantized linears' dequantized products through the product `choose` picks for their
    shape (by default `chosen_product` for serve.linear=`mode`, with fivefold's rows kernel among the
    candidates for float32 and bfloat16 weights where `rows_kernel`), in place, laying each block product's
    weight out input-major where that product runs it faster so (and back in the plain layout where a model
    routed before now takes a plain product); how many products each library runs."""
    if choose is None:
        def choose(shape, dtype, layouts):
            return chosen_product(shape, dtype, mode, layouts, rows_kernel and dtype in ROWS_DTYPES)
    routed = Counter()
    # Kept in their layout: the embedding and LM head. Left alone: the fused products' parts (views into their
    # fused weight, laid out with it), which do not run; a model unfused later runs them on F.linear, and the
    # next engine routes them.
    keep = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        keep.add(id(model.lm_head.weight))
    parts = set()
    with torch.no_grad():
        for module in model.modules():  # a fused module comes before its parts
            quantized = module.__dict__.get("qkv_quant", module.__dict__.get("gate_up_quant"))
            fused = ("qkv_weight", ("q_proj", "k_proj", "v_proj")) if isinstance(module, FusedAttention) else \
                ("gate_up_weight", ("gate_proj", "up_proj")) if hasattr(module, "gate_up_weight") else None
            if quantized is not None or (isinstance(module, QuantLinear) and module.qweight.device.type == "cpu"):
                # its dequantized products (more rows than it reads codes for), over a weight made each call
                linear = quantized if quantized is not None else module
                product = choose((linear.out_features, linear.in_features), linear.dtype, False)
                linear.linear_fn = product.fn
            elif fused:
                parts.update(id(getattr(module, name).weight) for name in fused[1])
                weight = getattr(module, fused[0])
                if weight.device.type != "cpu":
                    continue
                product = choose(tuple(weight.shape), weight.dtype, True)
                module.linear_fn = product.fn
                if product.input_major != is_input_major(weight):  # another engine's choice laid it out
                    _relay(module, *fused, product.input_major)
            elif type(module) in (nn.Linear, RoutedLinear) and module.weight.device.type == "cpu" \
                    and id(module.weight) not in parts:
                w = module.weight
                product = choose(tuple(w.shape), w.dtype, id(w) not in keep)
                module.__class__ = RoutedLinear
                module.linear_fn = product.fn
                if product.input_major != is_input_major(w):
                    w.data = laid_out(w, product.input_major)
            else:
                continue
            routed[product.library] += 1
    return routed


def serving_product(device: torch.device, shape: tuple[int, int], dtype: torch.dtype, mode: str = "auto",
                    rows_kernel: bool = False):
    """(the linear function, the weight layout) the engine runs a block product of `shape` with on `device`
    for serve.linear=`mode`, with the rows kernel among the candidates where `rows_kernel` (float32, bfloat16):
    what calibration times."""
    if device.type == "cpu" and mode != "torch" and candidates(mode, False):
        product = chosen_product(shape, dtype, mode, rows_kernel=rows_kernel and dtype in ROWS_DTYPES)
        return product.fn, (input_major if product.input_major else lambda weight: weight)
    return F.linear, lambda weight: weight
