"""A quantized weight dequantized for its product (fivefold.quant.formats.QuantizedWeight.dequantize), as it runs
(DEQUANT_CHUNK elements of rows at a time, in place where the weight is fp32) against the whole weight's
out-of-place formula it replaced, on a model's linear shapes: the time, the peak of what each holds (measured op
by op, fivefold.memory.live_peak), what `dequantized_bytes` plans, and that the two agree bit for bit.

A quantized engine's prefill chunks (and on a GPU every step) dequantize each weight: its time is the step's,
its peak sits on top of the forward's activations (fivefold.serve.step_memory).

    python bench/quant_dequantize.py --json bench/results/quant_dequantize_cpu.json        # smollm2-135m, ~1 min
    python bench/quant_dequantize.py --preset llama3.2-1b --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from fivefold.config_load import load_config
from fivefold.memory.live_peak import LivePeak
from fivefold.quant.formats import QuantizedWeight, dequantized_bytes, quantize_int4, quantize_int8, unpack_int4
from machine import base_info, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m", help="the model whose linear shapes are dequantized")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--group-size", type=int, default=64, help="int4's input columns per scale")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    return p.parse_args(argv)


def whole_weight(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight computed whole, out of place, in fp32, then cast: how dequantize ran before it took chunks."""
    out_f, in_f = qw.shape
    if qw.method == "int8":
        return (qw.qweight.float() * qw.scales.float()).to(dtype)
    q = unpack_int4(qw.qweight).view(out_f, in_f // qw.group_size, qw.group_size)
    return ((q.float() - qw.zeros.float()[..., None]) * qw.scales.float()[..., None]).view(out_f, in_f).to(dtype)


def best_us(fn, reps: int, device: str) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def peak(fn) -> int:
    with LivePeak() as held:
        fn()
    return held.peak


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """The serving engine's linears of one block (q/k/v and gate/up fused), (out, in)."""
    m = load_config(preset=preset).model
    return {"qkv": (m.q_size + 2 * m.kv_size, m.hidden_size), "o": (m.hidden_size, m.q_size),
            "gate_up": (2 * m.ffn_hidden_size, m.hidden_size), "down": (m.hidden_size, m.ffn_hidden_size)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name, shape in shapes(args.preset).items():
        w = torch.randn(shape, device=args.device)
        for method, qw in (("int8", quantize_int8(w)), ("int4", quantize_int4(w, args.group_size))):
            for dtype in (torch.float32, torch.bfloat16):
                same = torch.equal(qw.dequantize(dtype), whole_weight(qw, dtype))
                row = {"linear": name, "shape": list(shape), "method": method, "dtype": str(dtype).removeprefix("torch."),
                       "same": same, "chunked_us": best_us(lambda: qw.dequantize(dtype), args.reps, args.device),
                       "whole_us": best_us(lambda: whole_weight(qw, dtype), args.reps, args.device),
                       "chunked_peak": peak(lambda: qw.dequantize(dtype)),
                       "whole_peak": peak(lambda: whole_weight(qw, dtype)),
                       "planned": dequantized_bytes(method, shape, dtype.itemsize)}
                rows.append(row)
                print(f"{name:>7} {str(shape):>12} {method} {row['dtype']:>8}: {row['chunked_us']:7.0f} us, whole "
                      f"weight {row['whole_us']:7.0f} us ({row['whole_us'] / row['chunked_us']:.2f}x); peak "
                      f"{row['chunked_peak'] / 2**20:6.2f} MiB (planned {row['planned'] / 2**20:6.2f}), whole "
                      f"{row['whole_peak'] / 2**20:6.2f} MiB; same values: {same}", flush=True)
    out = {**base_info(args.device), "preset": args.preset, "device": args.device, "group_size": args.group_size,
           "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
