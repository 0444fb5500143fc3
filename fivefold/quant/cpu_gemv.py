"""Weight-only quantized products for a decode's few rows on a CPU, reading the codes directly.

A batch-1 decode streams every weight once a token, so int8 codes should cost a quarter of float32's time
and int4 an eighth. torch's kernels for them do not deliver that at a few rows on a CPU: on the project's
2-vCPU machine `torch._weight_int8pack_mm` read 2.9 GB/s of codes at one row (float32's oneDNN product reads
33) and `_weight_int4pack_mm_for_cpu` 0.6; dequantizing to float32 first writes the whole weight. Written as a
reduction (each output the sum over its row of code times input, times the row's or group's scale),
torch.compile's CPU backend makes one loop that converts each code in registers as it is read: 15-36 GB/s
of int8 codes and 10-16 of int4 over `smollm2-135m`'s shapes there at one row. For several rows the loop over
outputs is outside and the rows inside, so each code row is read once and used for every input row while it
is in cache; up to ROWS_READ_FROM_CODES rows that beats dequantizing (measured below). Compiled once per
kernel with dynamic shapes (every weight shape and row count shares the code); where compiling fails (no C++
compiler, say) the caller keeps its other path, and `gemv_problem()` says why.

Each product equals F.linear on the dequantized weight to float32 rounding (tested); it sums in another
order, so its last bits differ from that path's.
"""

from __future__ import annotations

import functools

import torch

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


def int8_rows(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (rows, in) -> (out, rows): each code row multiplied into every input row while it is in cache (the
    loop over outputs outside, the rows inside), so the codes are read once for all rows."""
    return (qweight.to(x.dtype)[:, None, :] * x[None]).sum(-1) * scales.to(x.dtype)


def int4_rows(x_even: torch.Tensor, x_odd: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor) -> torch.Tensor:
    """int4_row for several rows: x_even, x_odd (rows, groups, g / 2) -> (out, rows)."""
    out, (_, groups, half) = qweight.shape[0], x_even.shape
    packed = qweight.view(out, 1, groups, half).to(torch.int32)
    zero = zeros.to(x_even.dtype)[:, None, :, None]
    low, high = (packed & 0xF).to(x_even.dtype), (packed >> 4).to(x_even.dtype)
    per_group = ((low - zero) * x_even[None] + (high - zero) * x_odd[None]).sum(-1)  # (out, rows, groups)
    return (per_group * scales.to(x_even.dtype)[:, None, :]).sum(-1)


KERNELS = {"int8": int8_row, "int4": int4_row, "int8 rows": int8_rows, "int4 rows": int4_rows}
# Rows up to which reading the codes beats dequantizing the weight for oneDNN's product, per method (2-vCPU
# machine, 3072 x 576 and 576 x 1536 weights: int8 51-36 us at 1 row against 245-976, 232-133 at 8 against
# 297-152, 419-240 at 16 against 346-186; int4 922-434 at 16 against 2291-407, 1813-820 at 32 against
# 3108-468). Int4's dequantization costs more, so it reads its codes for more rows.
ROWS_READ_FROM_CODES = {"int8": 8, "int4": 16}


@functools.cache
def _kernel(name: str):
    return torch.compile(KERNELS[name], dynamic=True, fullgraph=True)


def gemv_problem() -> str | None:
    """Why the compiled products cannot run here (None when they can, or before the first try)."""
    return _problem[0] if _problem else None


def quantized_rows(method: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """The product of float32 rows `x` (rows, in) with a quantized weight ("int8" or "int4" layout), (rows,
    out); None where the compiled kernels cannot run (the caller then computes it another way). One row takes
    the one-row kernel, more the kernel that reads the codes once for all of them."""
    if _problem:
        return None
    rows = x.shape[0]
    try:
        if method == "int8":
            if rows == 1:
                return _kernel("int8")(x[0], qweight, scales)[None]
            return _kernel("int8 rows")(x, qweight, scales).t()
        halves = x.view(rows, -1, group_size // 2, 2)  # (rows, groups, g / 2, 2): column 2j + k at [.., j, k]
        even, odd = halves[..., 0].contiguous(), halves[..., 1].contiguous()
        if rows == 1:
            return _kernel("int4")(even[0], odd[0], qweight, scales, zeros)[None]
        return _kernel("int4 rows")(even, odd, qweight, scales, zeros).t()
    except Exception as e:  # noqa: BLE001 - any compiler failure means the same: use the other path
        _problem.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300])
        return None
