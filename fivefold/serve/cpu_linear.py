"""The serving model's linears on a CPU through oneDNN (serve.linear).

F.linear on a CPU runs MKL: at a decode's few rows its sgemv reads the weights on one thread, 17 GB/s on
this project's 2-vCPU machine where a sum over the same tensors reads 45-48 GB/s, and its GEMMs of a few
dozen rows are little better. oneDNN's inner product (`mkldnn._linear_pointwise`, the op torch.compile's CPU
backend emits for a linear) spreads both over the threads: on the same machine it reads ~24-37 GB/s at one
row, and `bench/serve.py` measures what that gives a whole engine.

A block product's weight is also laid out input-major (the same (out, in) parameter, stored as the
transpose of an (in, out) contiguous tensor) where oneDNN runs that layout faster at decode sizes, which
depends on the shape and the machine: on the 2-vCPU machine `smollm2-135m`'s 576-wide products ran 10-70%
faster at 1-32 rows (o_proj 24 -> 41 GB/s at one row, down_proj 28 -> 40) and a 2048 x 2048 one 20-40%
slower. So each distinct shape is timed once per machine in both layouts (`input_major_pays`; the choice is
kept in the cache directory, so every start of a server sums in the same order) and the faster kept. The LM
head keeps its layout: it is the embedding too where they are tied, whose lookups read rows. Nothing is held
twice (each weight is re-laid one at a time), names and shapes are unchanged, and
`Engine.update_weights` still copies into the same parameters; this is a choice of kernel and layout only:
the same product, summed in another order.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.data.corpus import cache_dir
from fivefold.quant.linear import QuantLinear
from fivefold.serve.fused import FusedAttention


def onednn_available() -> bool:
    """torch was built with oneDNN and has the inner-product op (every x86 and aarch64 CPU wheel)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on oneDNN: x (..., in), weight (out, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose product runs on oneDNN; parameters, names and hooks (LoRA adapters) unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values stored as the transpose of a contiguous (in, out) tensor."""
    return weight.detach().t().contiguous().t()


# Decode sizes a layout is chosen at; the bytes of weights it is timed over (beyond a server CPU's last-level
# cache, as a served model's weights are); how much faster input-major must time to be taken; and the
# smallest weight worth timing (below it a product is its call's overhead, whatever the layout).
LAYOUT_ROWS, LAYOUT_BYTES, LAYOUT_GAIN, LAYOUT_MIN_BYTES = (1, 16), 96 * 2**20, 1.05, 2**20
LAYOUTS_FILE = "cpu_layouts.json"  # in the cache directory (fivefold.data.corpus.cache_dir)
_chosen: dict[str, bool] = {}


def _machine() -> str:
    """What a layout choice holds for: this CPU model, the thread count and torch's version."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _saved() -> dict[str, dict[str, bool]]:
    try:
        data = json.loads((cache_dir() / LAYOUTS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: time again
        return {}


def _save(key: str, choice: bool) -> None:
    data = _saved()
    data.setdefault(_machine(), {})[key] = choice
    path = cache_dir() / LAYOUTS_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _time_layouts(shape: tuple[int, int], dtype: torch.dtype, size: int) -> dict[str, float]:
    """Seconds of oneDNN's product at LAYOUT_ROWS rows over copies of random `shape` weights, per layout."""
    out, inp = shape
    copies = min(64, -(-LAYOUT_BYTES // size))
    plain = [torch.randn(out, inp).to(dtype) for _ in range(copies)]
    seconds = {}
    for name, weights in (("plain", plain), ("input-major", [input_major(w) for w in plain])):
        xs = [torch.randn(m, inp).to(dtype) for m in LAYOUT_ROWS]
        for x in xs:
            onednn_linear(x, weights[0])
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for x in xs:
                for w in weights:
                    onednn_linear(x, w)
            times.append(time.perf_counter() - start)
        seconds[name] = min(times)
    return seconds


def input_major_pays(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether oneDNN's product over (out, in) = `shape` weights runs faster (by LAYOUT_GAIN) laid out
    input-major, at LAYOUT_ROWS rows together. Timed once per machine and shape, on random weights, and kept
    in the cache directory: each layout sums in its own order, so a close call that fell one way at one start
    and the other way at the next would change the last bits of the logits between two starts of a server."""
    out, inp = shape
    size = out * inp * torch.empty((), dtype=dtype).element_size()
    if size < LAYOUT_MIN_BYTES:
        return False
    key = f"{out}x{inp} {str(dtype).removeprefix('torch.')}"
    if key not in _chosen:
        saved = _saved().get(_machine(), {})
        if isinstance(saved.get(key), bool):
            _chosen[key] = saved[key]
        else:
            seconds = _time_layouts((out, inp), dtype, size)
            _chosen[key] = seconds["plain"] > LAYOUT_GAIN * seconds["input-major"]
            try:
                _save(key, _chosen[key])
            except OSError:  # a read-only cache: the choice holds for this process, and is timed again next start
                pass
    return _chosen[key]


def _relay(module: nn.Module, fused: str, parts: tuple[str, ...]) -> None:
    """Re-lay a fused weight input-major and re-point its parts' parameters at their rows of it."""
    weight = input_major(getattr(module, fused))
    setattr(module, fused, weight)
    start = 0
    for name in parts:
        linear = getattr(module, name)
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start:start + rows]
        start += rows


def use_onednn(model: nn.Module, pays: Callable[[tuple[int, int], torch.dtype], bool] = input_major_pays) -> int:
    """Route every plain linear of `model` (on a CPU, in float32 or bfloat16), its fused q/k/v and gate/up
    products and its quantized linears' dequantized products through oneDNN, in place, laying out
    input-major each block product's weight whose shape `pays` says runs faster so; the number of products
    routed."""
    routed = 0
    # Left as they are: the embedding and LM head, and the fused products' parts (views into their fused
    # weight, laid out with it).
    keep = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        keep.add(id(model.lm_head.weight))
    with torch.no_grad():
        for module in model.modules():
            quantized = module.__dict__.get("qkv_quant", module.__dict__.get("gate_up_quant"))
            fused = ("qkv_weight", ("q_proj", "k_proj", "v_proj")) if isinstance(module, FusedAttention) else \
                ("gate_up_weight", ("gate_proj", "up_proj")) if hasattr(module, "gate_up_weight") else None
            if quantized is not None:  # a fused QuantLinear (fivefold.serve.fused), not among the modules
                quantized.linear_fn = onednn_linear
                routed += 1
            elif fused:
                module.linear_fn = onednn_linear
                weight = getattr(module, fused[0])
                keep.update(id(getattr(module, name).weight) for name in fused[1])
                if pays(tuple(weight.shape), weight.dtype):
                    _relay(module, *fused)
                routed += 1
            elif isinstance(module, QuantLinear) and module.qweight.device.type == "cpu":
                module.linear_fn = onednn_linear  # its dequantized products (more rows than it reads codes for)
                routed += 1
            elif isinstance(module, OneDNNLinear):  # routed by an earlier engine on this model
                routed += 1
            elif type(module) is nn.Linear and module.weight.device.type == "cpu":
                module.__class__ = OneDNNLinear
                w = module.weight
                if id(w) not in keep and pays(tuple(w.shape), w.dtype):
                    w.data = input_major(w)
                routed += 1
    return routed


def serving_linear(device: torch.device, choice: str = "auto"):
    """(the linear function, the weight layout) the engine runs a block product with on `device` for
    serve.linear=`choice`: what calibration times."""
    if device.type == "cpu" and choice != "torch" and onednn_available():
        return onednn_linear, lambda w: input_major(w) if input_major_pays(tuple(w.shape), w.dtype) else w
    return F.linear, lambda weight: weight
