"""The products a training step runs, timed one by one against the step-time model's price for each.

The planner prices a matmul at peak x matmul_efficiency x prod(d / (d + knee)) over its three dimensions
(fivefold.planner.speed.matmul_seconds). `fivefold calibrate` fits the knee from square products only, and on
an H100 the model reads the 1B and 3B shapes' steps 10-14% slow while published runs at wider shapes read
optimistic (docs/planner_validation.md). This times the products themselves: for each model and tokens per
micro-batch, every linear of a block (q, k, v and q/k/v fused, o, gate, up and gate/up fused, down) and the
LM head, each as the step runs it: forward x W^T, input gradient g W, weight gradient g^T x. Then it fits
the knee and efficiency that price these shapes best, beside the profile's.

    python bench/matmul_shapes.py --device cuda --json bench/results/matmul_shapes_h100.json   # ~30 s on an H100
    python bench/matmul_shapes.py --rows bench-30m:2048 --cluster cpu.toml                    # a CPU profile

CUDA times are CUDA events over back-to-back products (the best of several rounds); CPU times the best
wall time of several repetitions.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fivefold.config import ConfigError  # noqa: E402
from fivefold.config_load import load_config  # noqa: E402
from fivefold.planner.hardware import load_profile, profile_for_device_name  # noqa: E402
from fivefold.planner.speed import matmul_seconds  # noqa: E402
from fivefold.presets import PRESETS  # noqa: E402
from fivefold.train.metrics import cuda_matmul_seconds  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The tokens per micro-batch of bench/gpu_train.sh's rows: the 1B's --fit choice (16 x 2048), the 3B at 4, 135M at 8.
CUDA_ROWS = "llama3.2-1b:32768,llama3.2-3b:8192,smollm2-135m:16384"
CPU_ROWS = "bench-30m:2048"
PASSES = ("forward", "grad_input", "grad_weight")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", default="", help=f"PRESET:TOKENS,... (default: {CUDA_ROWS} on CUDA, {CPU_ROWS} on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="")
    p.add_argument("--cluster", default="", help="hardware profile to price with (default: matched from the GPU's "
                                                 "name; a CPU needs one, e.g. from `fivefold calibrate`)")
    p.add_argument("--reps", type=int, default=0, help="products per timing (default: 10 on CUDA, 3 on CPU)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    args.rows = args.rows or (CUDA_ROWS if args.device == "cuda" else CPU_ROWS)
    for spec in args.rows.split(","):
        preset, _, tokens = spec.partition(":")
        if preset not in PRESETS or not tokens.isdigit() or int(tokens) < 1:
            p.error(f"--rows {spec!r}: want PRESET:TOKENS with a preset of `fivefold presets` and TOKENS >= 1, "
                    f"e.g. {CPU_ROWS}")
    if args.cluster:
        try:
            load_profile(args.cluster)
        except ConfigError as e:
            p.error(f"--cluster: {e}")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.reps = args.reps or (10 if args.device == "cuda" else 3)
    return args


def linears(preset: str) -> dict[str, tuple[int, int]]:
    """Name -> (in, out) of each distinct linear of a block, fused forms included, and the LM head."""
    m = load_config(preset=preset).model
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_hidden_size
    out = {"q": (h, q), "k": (h, kv), "qkv": (h, q + 2 * kv), "o": (q, h)}
    if m.activation == "swiglu":
        out.update({"gate": (h, f), "gate_up": (h, 2 * f)})
    out.update({"down": (f, h), "head": (h, m.vocab_size)})
    return out  # v has k's shape


def pass_shape(tokens: int, k: int, n: int, which: str) -> tuple[int, int, int]:
    """(m, k, n) of one pass of a linear k -> n over `tokens` rows."""
    return {"forward": (tokens, k, n), "grad_input": (tokens, n, k), "grad_weight": (n, tokens, k)}[which]


def operands(tokens: int, k: int, n: int, which: str, device, dtype):
    """The pass's two operands laid out as autograd hands them to the product."""
    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)
    if which == "forward":  # x (T, k) @ W^T, W (n, k)
        return rand(tokens, k), rand(n, k).t()
    if which == "grad_input":  # g (T, n) @ W (n, k)
        return rand(tokens, n), rand(n, k)
    return rand(tokens, n).t(), rand(tokens, k)  # g^T (n, T) @ x (T, k)


def time_product(a: torch.Tensor, b: torch.Tensor, reps: int, rounds: int = 3) -> float:
    """Seconds of one a @ b: CUDA events on a GPU (fivefold.train.metrics.cuda_matmul_seconds); on a CPU the
    best wall time of `rounds` runs of `reps` back-to-back products."""
    if a.is_cuda:
        return cuda_matmul_seconds(a, b, reps, rounds)
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    torch.matmul(a, b, out=out)
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def fit_knee(shapes: list[tuple[int, int, int]], seconds: list[float], peak: float,
             knees=range(0, 4097, 8)) -> tuple[float, float, float]:
    """(knee, efficiency, rms log error) of matmul_seconds that fits the measured `seconds` best in log space;
    for each knee the best efficiency is the geometric mean of the ratios, so only the knee is searched."""
    best = (0.0, 1.0, math.inf)
    for knee in knees:
        logs = [math.log(matmul_seconds(*s, peak, 1.0, knee) / t) for s, t in zip(shapes, seconds)]
        log_eff = statistics.fmean(logs)
        rms = math.sqrt(statistics.fmean([(x - log_eff) ** 2 for x in logs]))
        if rms < best[2]:
            best = (float(knee), math.exp(log_eff), rms)
    return best


def device_profile(device: torch.device, cluster: str, dtype: str):
    """(the GPU's name or "", the profile's name or "", the profile for `dtype` or None): `cluster` where given,
    else the shipped profile matching the GPU's name."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    name = cluster or (profile_for_device_name(gpu) if gpu else "")
    return gpu, name or "", load_profile(name).for_dtype(dtype) if name else None


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gpu, name, profile = device_profile(device, args.cluster, args.dtype)
    if profile is None:
        print("no hardware profile (--cluster): products timed, not priced", flush=True)
    peak = profile.peak_flops(args.dtype) if profile else 0.0
    print(f"{gpu or 'cpu'}, {args.dtype}, profile {name or '-'}"
          + (f": peak {peak / 1e12:.0f} TFLOP/s x efficiency {profile.matmul_efficiency}, knee "
             f"{profile.matmul_knee:g}" if profile else ""), flush=True)
    rows = []
    header = (f"{'model':<14} {'linear':<8} {'pass':<11} {'m x k x n':>22} {'ms':>8} {'TFLOP/s':>8}"
              + (f" {'model':>8} {'error':>7}" if profile else ""))
    print(header + ("  (model: the profile's TFLOP/s; error: model / measured - 1, > 0 optimistic)" if profile else ""))
    for spec in args.rows.split(","):
        preset, tokens = spec.split(":")
        tokens = int(tokens)
        for lin, (k, n) in linears(preset).items():
            for which in PASSES:
                shape = pass_shape(tokens, k, n, which)
                a, b = operands(tokens, k, n, which, device, dtype)
                seconds = time_product(a, b, args.reps)
                del a, b
                row = {"model": preset, "tokens": tokens, "linear": lin, "pass": which, "shape": shape,
                       "seconds": seconds, "flops_per_s": 2 * math.prod(shape) / seconds}
                if profile:
                    row["predicted_seconds"] = matmul_seconds(*shape, peak, profile.matmul_efficiency,
                                                              profile.matmul_knee)
                    # the planner's convention: predicted / measured rate - 1 (> 0: the model is optimistic)
                    row["error"] = seconds / row["predicted_seconds"] - 1
                rows.append(row)
                print(f"{preset:<14} {lin:<8} {which:<11} {' x '.join(map(str, shape)):>22} {1e3 * seconds:8.3f} "
                      f"{row['flops_per_s'] / 1e12:8.1f}"
                      + (f" {2 * math.prod(shape) / row['predicted_seconds'] / 1e12:8.1f} "
                         f"{100 * row['error']:+6.1f}%" if profile else ""), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {"device": gpu or "cpu", "dtype": args.dtype, "profile": name, "rows": rows}
    if profile:
        shapes, seconds = [r["shape"] for r in rows], [r["seconds"] for r in rows]
        knee, eff, rms = fit_knee(shapes, seconds, peak)
        shipped = [math.log(r["predicted_seconds"] / r["seconds"]) for r in rows]
        out["fit"] = {"knee": knee, "efficiency": eff, "rms_log_error": rms,
                      "profile_knee": profile.matmul_knee, "profile_efficiency": profile.matmul_efficiency,
                      "profile_rms_log_error": math.sqrt(statistics.fmean([x * x for x in shipped])),
                      "profile_median_error": statistics.median([r["error"] for r in rows])}
        print(f"predicted / measured FLOP/s - 1: median {100 * out['fit']['profile_median_error']:+.1f}%, rms of the log "
              f"{out['fit']['profile_rms_log_error']:.3f} with the profile's knee {profile.matmul_knee:g} and "
              f"efficiency {profile.matmul_efficiency}; fitted to these products: knee {knee:g}, efficiency "
              f"{eff:.3f}, rms {rms:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
