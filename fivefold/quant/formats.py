"""How a quantized linear weight (out, in) is stored, and the round-to-nearest (RTN) quantizers.

int8   per-output-channel symmetric absmax: w ~= q * scale
         qweight int8 (out, in) in [-127, 127]; scales float32 (out, 1); zeros None; group_size = in.
int4   group-wise asymmetric, `group_size` input columns per group: w ~= (q - zero) * scale
gptq     qweight uint8 (out, in // 2): column 2j in the low nibble, 2j + 1 in the high one;
         scales float16 (out, in // group_size); zeros uint8 (out, in // group_size) in [0, 15].
         group_size -1 or 0 means one group per row (stored as group_size = in). GPTQ
         (fivefold.quant.gptq) chooses other codes on the same grid, so it shares the format.

A group's grid spans [min(w, 0), max(w, 0)] (GPTQ's reference quantizer does the same): with 0 inside
the range the zero point round(-min / scale) is an integer in [0, 15]. The float16 scale is rounded
*up* from (max - min) / 15, so the grid covers the whole range and every element, clipped or not, is
within scale / 2 of its code (tested). int8 keeps float32 scales: 4 bytes per row is nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("int8", "int4", "gptq")
# Elements of a weight dequantized at once (QuantizedWeight.dequantize): a 16M-element chunk's fp32 values are 64
# MB beside the weight, where dequantizing a Llama-3-8B gate/up product (117M elements) whole held 1 GB of them.
DEQUANT_CHUNK = 2**24
BITS = {"int8": 8, "int4": 4, "gptq": 4}
INT4_MAX = 15
INT8_MAX = 127


@dataclass
class QuantizedWeight:
    method: str  # "int8" | "int4" | "gptq"
    shape: tuple[int, int]  # (out, in) of the full-precision weight
    group_size: int  # input columns per scale (int8: in)
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight the codes stand for, computed in fp32 and cast to `dtype`: DEQUANT_CHUNK elements
        of rows at a time, in place where `dtype` is fp32, so that beside the weight it returns only one chunk's
        codes and fp32 values are held (dequantized_bytes), not the whole weight's several times over."""
        out_f, in_f = self.shape
        out = torch.empty(self.shape, dtype=dtype, device=self.qweight.device)
        rows = max(1, DEQUANT_CHUNK // in_f)
        for a in range(0, out_f, rows):
            b = min(a + rows, out_f)
            part = out[a:b] if dtype == torch.float32 else torch.empty((b - a, in_f), device=out.device)
            self._dequantize_rows(part, a, b)
            if part.dtype != dtype:
                out[a:b] = part
            del part  # before the next chunk's
        return out

    def _dequantize_rows(self, part: torch.Tensor, a: int, b: int) -> None:
        """Rows a:b of the weight into `part` (fp32), in place: (q - zero) * scale, each op as one pass."""
        if self.method == "int8":
            part.copy_(self.qweight[a:b]).mul_(self.scales[a:b].float())
            return
        groups = part.view(b - a, self.shape[1] // self.group_size, self.group_size)
        groups.copy_(unpack_int4(self.qweight[a:b]).view(groups.shape))
        groups.sub_(self.zeros[a:b].float()[..., None]).mul_(self.scales[a:b].float()[..., None])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        stored = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        return {k: v for k, v in stored.items() if v is not None}

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """{f"{prefix}.qweight": ..., ".scales", ".zeros" (not for int8)}: what a checkpoint stores."""
        return {f"{prefix}.{k}": v for k, v in self.tensors().items()}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], prefix: str, method: str, shape, group_size: int
                   ) -> "QuantizedWeight":
        """The inverse of `state`; every tensor's dtype and shape is checked against the declared
        (method, shape, group_size), so a file from another model fails here, by name."""
        shape = (int(shape[0]), int(shape[1]))
        group_size = resolve_group_size(shape[1], group_size, method)
        expected = stored_layout(shape, method, group_size)
        found = {}
        for key, (dtype, dims) in expected.items():
            name = f"{prefix}.{key}"
            if name not in tensors:
                raise ValueError(f"{name} is missing")
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape) != dims:
                raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; a {method} weight of shape {shape} with "
                                 f"group_size={group_size} stores {dtype} {dims}")
            found[key] = t
        return cls(method, shape, group_size, found["qweight"], found["scales"], found.get("zeros"))


def resolve_group_size(in_features: int, group_size: int, method: str = "int4") -> int:
    """The stored group size: `in_features` for int8 and for -1 / 0 (one group per row); otherwise
    `group_size`, which must divide `in_features`."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int8" or group_size in (-1, 0):
        return in_features
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide the input width {in_features}; choose a divisor "
                         f"of it, or -1 for one group per row")
    return group_size


def stored_layout(shape, method: str, group_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of a quantized weight: the one definition `from_state`, `expected_bytes`
    and the quantizers agree on."""
    out_f, in_f = shape
    if method == "int8":
        return {"qweight": (torch.int8, (out_f, in_f)), "scales": (torch.float32, (out_f, 1))}
    if in_f % 2:
        raise ValueError(f"int4 packs two columns per byte: the input width {in_f} must be even")
    groups = in_f // resolve_group_size(in_f, group_size, method)
    return {"qweight": (torch.uint8, (out_f, in_f // 2)), "scales": (torch.float16, (out_f, groups)),
            "zeros": (torch.uint8, (out_f, groups))}


def expected_bytes(shape, method: str, group_size: int) -> int:
    """Bytes a quantized (out, in) weight stores: int8 in + 4 per row; int4 / gptq in / 2 + 3 per group
    (a float16 scale and a uint8 zero point)."""
    layout = stored_layout(shape, method, group_size)
    return sum(dtype.itemsize * torch.Size(dims).numel() for dtype, dims in layout.values())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes (out, in) in [0, 15] -> (out, in // 2): column 2j low nibble, 2j + 1 high nibble."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4 takes uint8 codes (out, even in), got {q.dtype} {tuple(q.shape)}")
    if q.numel() and int(q.max()) > INT4_MAX:
        raise ValueError(f"int4 codes must be in [0, 15], found {int(q.max())}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def dequantized_bytes(method: str, shape: tuple[int, int], itemsize: int) -> int:
    """The most QuantizedWeight.dequantize holds at once for a weight of `shape` dequantized to a dtype of
    `itemsize` bytes: the weight it returns, and for one chunk of rows (DEQUANT_CHUNK) its fp32 values (unless
    they are the weight's own, in fp32) and int4's unpacked codes (the two nibble planes and their
    interleaving: 2 bytes an element)."""
    out_f, in_f = shape
    chunk = min(max(1, DEQUANT_CHUNK // in_f), out_f) * in_f
    return out_f * in_f * itemsize + chunk * ((4 if itemsize != 4 else 0) + (2 if BITS[method] == 4 else 0))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 (out, in // 2) -> uint8 codes (out, in)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def int4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of each group, one group per row of the last dim of `w` (..., g), in fp32: the scale
    on the float16 grid (rounded up, so the codes cover the range), the zero an integer in [0, 15]."""
    lo = w.amin(dim=-1).clamp(max=0).float()
    hi = w.amax(dim=-1).clamp(min=0).float()
    scale = (hi - lo) / INT4_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale is exact
    half = scale.half()
    if not torch.isfinite(half).all():
        raise ValueError(f"a weight group spans {float((hi - lo).max()):.3g}: too wide for a float16 scale")
    # One float16 step up where rounding went down: positive float16 bit patterns order like their values.
    half = torch.where(half.float() < scale, (half.view(torch.int16) + 1).view(torch.float16), half)
    scale = half.float()
    zero = torch.round(-lo / scale).clamp(0, INT4_MAX)
    return scale, zero


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes of `w` on the grid (scale, zero) broadcast to it, as fp32 in [0, 15]."""
    return (torch.round(w.float() / scale) + zero).clamp(0, INT4_MAX)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel absmax int8 (LLM.int8()'s vector-wise quantization, without its
    outlier decomposition)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX  # (out, 1)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # Contiguous whatever `w`'s layout (a served model's weight may be stored input-major): the kernels
    # that read the codes take them row-major.
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
    return QuantizedWeight("int8", tuple(w.shape), w.shape[1], q, scale.contiguous())


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Group-wise asymmetric int4, round to nearest."""
    w = w.detach().float().contiguous()
    out_f, in_f = w.shape
    g = resolve_group_size(in_f, group_size)
    stored_layout(w.shape, "int4", g)  # the width checks
    groups = w.view(out_f, in_f // g, g)
    scale, zero = int4_grid(groups)  # (out, groups)
    q = int4_codes(groups, scale[..., None], zero[..., None]).to(torch.uint8).view(out_f, in_f)
    return QuantizedWeight("int4", (out_f, in_f), g, pack_int4(q).contiguous(), scale.half().contiguous(),
                           zero.to(torch.uint8).contiguous())


def from_codes(method: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
               ) -> QuantizedWeight:
    """An int4-format weight from fp32 codes (out, in) and per-group fp32 (scale, zero) (out, groups)."""
    return QuantizedWeight(method, tuple(codes.shape), group_size, pack_int4(codes.to(torch.uint8)).contiguous(),
                           scale.half().contiguous(), zero.to(torch.uint8).contiguous())
