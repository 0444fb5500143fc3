"""One large product run back to back for minutes, as a training run keeps a GPU busy, against the brief timing
the hardware profiles are priced from.

bench/matmul_shapes.py (and the profiles fitted to it) keeps the best of three runs of ten products: a second of
work on a GPU that was idle before. Published training runs keep their GPUs under load for days, at the power
limit, where clocks can settle lower (docs/planner_validation.md: the planner reads 14 of 16 published runs
optimistic, most on H100s). This measures whether a product slows once the GPU is hot: it runs one m x k x n
product (random normal operands, the data that draws the most power) for --seconds, timing each chunk of ~0.2 s
with CUDA events, and prints the rate in windows of --window seconds with the SM clock, power and temperature
where torch can read them (pynvml). The figure it ends with, the last 30 s's rate over the brief timing's, is what
a profile's matmul efficiency would need to take for sustained load.

    python bench/matmul_sustained.py --device cuda --seconds 120 --json bench/results/matmul_sustained_h200.json
    python bench/matmul_sustained.py --device cpu --size 256 --seconds 3 --window 1    # a CPU check
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import write_results
from matmul_shapes import DTYPES, device_profile, time_product

from fivefold.planner.speed import matmul_seconds

CHUNK_S = 0.2  # each timed chunk's length: short enough to follow the clock, long enough that a sync costs nothing


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", type=int, default=8192, help="m = k = n of the product")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="")
    p.add_argument("--seconds", type=float, default=120.0, help="how long the product runs back to back")
    p.add_argument("--window", type=float, default=5.0, help="seconds a printed rate covers")
    p.add_argument("--tail", type=float, default=30.0, help="seconds at the end whose rate is the sustained one")
    p.add_argument("--cluster", default="", help="hardware profile to price with (default: matched from the GPU)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.size < 1 or args.seconds <= 0 or args.window <= 0 or args.tail <= 0:
        p.error("--size, --seconds, --window and --tail must be positive")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def sensors(device: torch.device) -> dict:
    """The GPU's SM clock (MHz), power (W) and temperature (C) now, each where torch can read it (pynvml)."""
    out = {}
    if device.type != "cuda":
        return out
    for key, read, scale in (("clock_mhz", torch.cuda.clock_rate, 1.0), ("power_w", torch.cuda.power_draw, 1e-3),
                             ("temperature_c", torch.cuda.temperature, 1.0)):
        try:
            out[key] = read(device) * scale
        except Exception:  # no pynvml, or a GPU that does not report it: leave it out
            pass
    return out


def windows(chunks: list[dict], window: float, flops: float) -> list[dict]:
    """The chunks grouped by the window their start falls in: each window's rate (its products' FLOPs over their
    time) and its sensors' means."""
    groups: dict[int, list[dict]] = {}
    for c in chunks:
        groups.setdefault(int(c["t"] // window), []).append(c)
    out = []
    for index in sorted(groups):
        group = groups[index]
        row = {"start_s": index * window, "flops_per_s": rate(group, flops)}
        for key in ("clock_mhz", "power_w", "temperature_c"):
            values = [c[key] for c in group if key in c]
            if values:
                row[key] = statistics.fmean(values)
        out.append(row)
    return out


def show(rows: list[dict], printed: int) -> int:
    """Print rows[printed:]; -> how many are printed now."""
    for row in rows[printed:]:
        extra = "".join(f"  {row[k]:.0f} {unit}" for k, unit in (("clock_mhz", "MHz"), ("power_w", "W"),
                                                                ("temperature_c", "C")) if k in row)
        print(f"  {row['start_s']:6.0f} s  {row['flops_per_s'] / 1e12:8.1f} TFLOP/s{extra}", flush=True)
    return max(printed, len(rows))


def rate(chunks: list[dict], flops: float) -> float:
    """The chunks' products' FLOPs over their time."""
    return flops * sum(c["reps"] for c in chunks) / sum(c["seconds"] * c["reps"] for c in chunks)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gpu, name, profile = device_profile(device, args.cluster, args.dtype)
    n = args.size
    flops = 2.0 * n ** 3
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    # The profiles' timing, on the GPU as it was idle: bench/matmul_shapes.py's best of three runs of ten.
    brief = time_product(a, b, 10 if device.type == "cuda" else 3)
    reps = max(1, round(min(CHUNK_S, args.window / 4) / brief))  # several chunks a window
    print(f"{gpu or 'cpu'}, {args.dtype}, {n}^3: brief best {flops / brief / 1e12:.1f} TFLOP/s; running "
          f"{args.seconds:g} s in chunks of {reps} products", flush=True)
    chunks = []
    began = time.perf_counter()
    printed = 0
    while (elapsed := time.perf_counter() - began) < args.seconds:
        chunks.append({"t": elapsed, "reps": reps, "seconds": time_product(a, b, reps, rounds=1), **sensors(device)})
        done = windows(chunks, args.window, flops)
        printed = show(done[:-1], printed)  # a window is printed once the next has begun
    show(windows(chunks, args.window, flops), printed)
    total = time.perf_counter() - began
    first = [c for c in chunks if c["t"] < min(args.window, total / 3)]
    last = [c for c in chunks if c["t"] >= total - min(args.tail, total / 3)] or chunks[-1:]
    result = {
        "device": gpu or "cpu", "dtype": args.dtype, "size": n, "seconds": total, "chunk_products": reps,
        "brief_flops_per_s": flops / brief, "first_flops_per_s": rate(first, flops),
        "sustained_flops_per_s": rate(last, flops), "windows": windows(chunks, args.window, flops),
        "profile": name,
    }
    result["sustained_over_brief"] = result["sustained_flops_per_s"] / result["brief_flops_per_s"]
    result["sustained_over_first"] = result["sustained_flops_per_s"] / result["first_flops_per_s"]
    if profile:
        peak = profile.peak_flops(args.dtype)
        result["profile_flops_per_s"] = flops / matmul_seconds(n, n, n, peak, profile.matmul_efficiency,
                                                               profile.matmul_knee)
    print(f"brief best {result['brief_flops_per_s'] / 1e12:.1f}, first window {result['first_flops_per_s'] / 1e12:.1f}, "
          f"last {min(args.tail, total / 3):.0f} s {result['sustained_flops_per_s'] / 1e12:.1f} TFLOP/s: sustained / "
          f"brief {result['sustained_over_brief']:.3f}, sustained / first {result['sustained_over_first']:.3f}"
          + (f"; profile {name} prices it at {result['profile_flops_per_s'] / 1e12:.1f}" if profile else ""))
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
