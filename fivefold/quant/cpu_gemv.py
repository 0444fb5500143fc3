"""Weight-only quantized products at one row on a CPU, reading the codes directly (a decode at batch 1).

A batch-1 decode streams every weight once a token, so int8 codes should cost a quarter of float32's time
and int4 an eighth. torch's kernels for them do not deliver that at one row on a CPU: on the project's
2-vCPU machine `torch._weight_int8pack_mm` read 2.9 GB/s of codes (float32's oneDNN product reads 33) and
`_weight_int4pack_mm_for_cpu` 0.6; dequantizing to float32 first writes the whole weight. Written as a
reduction (each output the sum over its row of code times input, times the row's or group's scale),
torch.compile's CPU backend makes one loop that converts each code in registers as it is read: 15-36 GB/s
of int8 codes and 10-16 of int4 over `smollm2-135m`'s shapes there (bench/serve.py --quant measures whole
decodes). Compiled once with dynamic shapes (every weight shape shares the code); where compiling fails
(no C++ compiler, say) the caller keeps its other path, and `gemv_problem()` says why.

Each product equals F.linear on the dequantized weight to float32 rounding (tested); it sums in another
order, so its last bits differ from that path's.
"""

from __future__ import annotations

import torch

_compiled: dict[str, object] = {}
_problem: list[str] = []  # why compiling failed here, once it has


def int8_row(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (in,) float32, qweight int8 (out, in), scales (out, 1) -> (out,): sum_j q[i, j] x[j] * scale[i]."""
    return (qweight.to(x.dtype) @ x) * scales.to(x.dtype).view(-1)


def int4_row(x_even: torch.Tensor, x_odd: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor) -> torch.Tensor:
    """x_even, x_odd (groups, g / 2): the input's even and odd columns, group by group (the packed byte
    j holds columns 2j and 2j + 1); qweight uint8 (out, in / 2); scales, zeros (out, groups) ->
    (out,): sum over groups of scale * sum_j (q - zero) x."""
    out, (groups, half) = qweight.shape[0], x_even.shape
    packed = qweight.view(out, groups, half).to(torch.int32)  # widened once: the nibble ops vectorise on int32
    zero = zeros.to(x_even.dtype)[..., None]
    low, high = (packed & 0xF).to(x_even.dtype), (packed >> 4).to(x_even.dtype)
    per_group = ((low - zero) * x_even + (high - zero) * x_odd).sum(-1)  # (out, groups)
    return (per_group * scales.to(x_even.dtype)).sum(-1)


KERNELS = {"int8": int8_row, "int4": int4_row}


def _kernel(name: str):
    if name not in _compiled:
        _compiled[name] = torch.compile(KERNELS[name], dynamic=True, fullgraph=True)
    return _compiled[name]


def gemv_problem() -> str | None:
    """Why the compiled products cannot run here (None when they can, or before the first try)."""
    return _problem[0] if _problem else None


def quantized_row(method: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """The product of one float32 row `x` (in,) with a quantized weight, (out,); None where the compiled
    kernels cannot run (the caller then computes it another way)."""
    if _problem:
        return None
    try:
        if method == "int8":
            return _kernel("int8")(x, qweight, scales)
        halves = x.view(-1, group_size // 2, 2)  # (groups, g / 2, 2): column 2j + k at [.., j, k]
        return _kernel("int4")(halves[..., 0].contiguous(), halves[..., 1].contiguous(), qweight, scales, zeros)
    except Exception as e:  # noqa: BLE001 - any compiler failure means the same: use the other path
        _problem.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300])
        return None

