"""The Triton kernels of fivefold.kernels (RMSNorm, the SwiGLU product, RoPE), forward + backward, against
the PyTorch path each replaces, run eagerly and under torch.compile, at the sizes of one Llama-3.2-1B
layer: 8192 tokens (4 x 2048), hidden 2048, ffn 8192, 32 heads x 64. On CUDA also the layer's attention
under each of SDPA's backends (flash, cuDNN, memory-efficient) beside the one it picks by default.

    python bench/kernels.py --json bench/results/kernels_h100.json      # CUDA: bf16 by default
    python bench/kernels.py --dtype fp32
    python bench/kernels.py --device cpu                                # a correctness check only

One step is forward, then backward of <out, g> for a fixed random g (the leaves' .grad reset first).
Each path is checked against eager first: output and every input gradient, as the largest difference
relative to the reference's largest value. Then the paths take turns, --repeats windows of --iters
steps each after --warmup steps, timed by CUDA events; the table gives the median window per step,
triton / eager and triton / compiled (below 1: Triton is faster), and the triton step's bandwidth
counting only the bytes it must move (inputs and saved tensors read, outputs and gradients written
once). train.kernels=triton pays where these ratios are below 1 on the GPU that trains.

On a CPU, Triton only interprets its kernels (TRITON_INTERPRET=1, set here before triton is imported):
the script checks them on small sizes and reports no time, since interpreter times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CPU_SIZES = dict(batch=2, seq=8, hidden=96, ffn=200, heads=4, head_dim=12)  # odd sizes, quick to interpret


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=20, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per path, taken in turns")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


@dataclass
class Case:
    """One kernel's inputs and its three ways of computing the same output from them."""
    name: str
    leaves: list[torch.Tensor]  # the inputs that get gradients
    grad: torch.Tensor  # d loss / d out
    paths: dict[str, Callable[[], torch.Tensor]]  # "eager", "compiled", "triton"
    min_bytes: int  # what forward + backward must read and write at least
    ms: dict[str, float] = field(default_factory=dict)
    check: dict[str, float] = field(default_factory=dict)

    def step(self, path: str) -> list[torch.Tensor]:
        for t in self.leaves:
            t.grad = None
        out = self.paths[path]()
        out.backward(self.grad)
        return [out.detach()] + [t.grad for t in self.leaves]


def make_cases(args, device: torch.device, dtype: torch.dtype, compile_torch: bool) -> list[Case]:
    import torch.nn.functional as F

    from fivefold.kernels.rmsnorm import rms_norm
    from fivefold.kernels.rope import apply_rope as rope_triton
    from fivefold.kernels.swiglu import swiglu
    from fivefold.model.layers import RMSNorm
    from fivefold.model.rope import apply_rope, rope_cos_sin

    gen = torch.Generator(device).manual_seed(0)
    tokens, size = args.batch * args.seq, torch.tensor([], dtype=dtype).element_size()

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def compiled(fn):
        return torch.compile(fn) if compile_torch else fn

    # RMSNorm: x (T, h); the module's own forward, with the leaf as its weight. Backward reads x, g (and w).
    norm = RMSNorm(args.hidden, eps=1e-5)
    norm.weight = torch.nn.Parameter(1 + 0.1 * randn(args.hidden))
    x = randn(tokens, args.hidden).requires_grad_()
    norm_fn = compiled(norm)
    cases = [Case("rmsnorm", [x, norm.weight], randn(tokens, args.hidden),
                  {"eager": lambda: norm(x), "compiled": lambda: norm_fn(x),
                   "triton": lambda: rms_norm(x, norm.weight, norm.eps)}, 5 * x.numel() * size)]

    # SwiGLU product: gate, up (T, f). Forward reads 2 writes 1; backward reads 3 writes 2.
    gate, up = randn(tokens, args.ffn).requires_grad_(), randn(tokens, args.ffn).requires_grad_()

    def product(g, u):
        return F.silu(g) * u

    product_fn = compiled(product)
    cases.append(Case("swiglu", [gate, up], randn(tokens, args.ffn),
                      {"eager": lambda: product(gate, up), "compiled": lambda: product_fn(gate, up),
                       "triton": lambda: swiglu(gate, up)}, 8 * gate.numel() * size))

    # RoPE on q as Attention makes it: (B, S, H, d) transposed to (B, H, S, d). Each way reads x, writes once.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    positions = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    q = randn(args.batch, args.seq, args.heads, args.head_dim).transpose(1, 2).requires_grad_()
    rope_fn = compiled(apply_rope)
    cases.append(Case("rope", [q], randn(args.batch, args.heads, args.seq, args.head_dim),
                      {"eager": lambda: apply_rope(q, cos, sin), "compiled": lambda: rope_fn(q, cos, sin),
                       "triton": lambda: rope_triton(q, cos, sin)}, 4 * q.numel() * size + 4 * cos.numel() * size))
    return cases


# The largest difference from eager a correct path shows (bf16: a few roundings, fused or not).
CHECK_LIMIT = {torch.float32: 1e-4, torch.bfloat16: 2**-5}


def check(case: Case, paths: list[str]) -> None:
    """Largest difference from eager, relative to eager's largest value, over output and gradients."""
    want = case.step("eager")
    for path in paths:
        got = case.step(path)
        case.check[path] = max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
                               for g, w in zip(got, want))
        limit = CHECK_LIMIT[want[0].dtype]
        assert case.check[path] < limit, f"{case.name}: {path} differs from eager by {case.check[path]:.1e} > {limit}"


def window_ms(step: Callable[[], object], iters: int) -> float:
    """Milliseconds a step over one window of `iters` steps, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def median_ms(steps: dict[str, Callable[[], object]], args) -> dict[str, float]:
    """Each step's median window after --warmup steps, the steps taking turns window by window (so a slow
    moment of the GPU or host hits every one)."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    windows = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            windows[name].append(window_ms(step, args.iters))
    return {name: statistics.median(ms) for name, ms in windows.items()}


def time_paths(case: Case, paths: list[str], args) -> None:
    case.ms = median_ms({path: (lambda path=path: case.step(path)) for path in paths}, args)


def print_table(cases: list[Case]) -> None:
    print(f"{'kernel':<8} {'eager ms':>9} {'compiled ms':>12} {'triton ms':>10} {'triton/eager':>13} "
          f"{'triton/compiled':>16} {'triton GB/s':>12}")
    for c in cases:
        ms = c.ms
        print(f"{c.name:<8} {ms['eager']:>9.3f} {ms['compiled']:>12.3f} {ms['triton']:>10.3f} "
              f"{ms['triton'] / ms['eager']:>13.2f} {ms['triton'] / ms['compiled']:>16.2f} "
              f"{c.min_bytes / ms['triton'] / 1e6:>12.0f}")


# SDPA's backends at the layer's attention. Which one F.scaled_dot_product_attention picks ("default") is
# torch's choice; training takes it (fivefold.model.attention), so a faster one here is speed left unused.
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def time_attention(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Causal GQA attention forward + backward at the layer's shape (kv heads: a quarter of the heads, as
    Llama-3.2-1B), under SDPA's default choice and under each backend alone: median ms, TFLOP/s (causal:
    half of 4 b h s^2 d forward, 2.5x that backward) and the largest difference from the default's output
    and gradients, relative to their largest value. A backend that cannot run the shape says why."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device).manual_seed(1)
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    kv = max(g for g in range(1, max(1, h // 4) + 1) if h % g == 0)  # a quarter of the heads, or the nearest divisor below
    shapes = {"q": (b, h, s, d), "k": (b, kv, s, d), "v": (b, kv, s, d)}
    leaves = {n: torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_() for n, shape in shapes.items()}
    grad = torch.randn(b, h, s, d, generator=gen, device=device).to(dtype)

    def step(backend: str | None) -> list[torch.Tensor]:
        for t in leaves.values():
            t.grad = None
        with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(*leaves.values(), is_causal=True, enable_gqa=True)
            out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves.values()]

    flops = 3.5 * 2 * b * h * s * s * d  # fwd 4bhs^2d / 2 (causal) + bwd 2.5x
    want = step(None)
    results = {}
    for backend in (None, *SDPA_BACKENDS):
        name = backend or "default"
        try:
            got = step(backend)
        except RuntimeError as e:  # a backend that does not take this shape, dtype or GPU
            results[name] = {"error": str(e).splitlines()[0][:200]}
            continue
        diff = max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
                   for g, w in zip(got, want))
        ms = median_ms({name: lambda backend=backend: step(backend)}, args)[name]
        results[name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_diff_from_default": diff}
    print(f"\nattention fwd + bwd, causal, {b} x {s} tokens, {h} heads / {shapes['k'][1]} kv heads x {d}:")
    for name, r in results.items():
        print(f"  {name:<20} " + (f"{r['ms']:>8.3f} ms {r['tflops']:>7.1f} TFLOP/s, "
                                  f"{r['ms'] / results['default']['ms']:.2f}x the default's time, "
                                  f"differs by {r['rel_diff_from_default']:.1e}" if "ms" in r else f"cannot run: {r['error']}"))
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    attention = None
    if not on_gpu:
        # Before anything imports triton (fivefold.model does, through torch._dynamo): triton.jit picks
        # the interpreter when a function is decorated.
        os.environ["TRITON_INTERPRET"] = "1"
        vars(args).update(CPU_SIZES)
        print(f"note: on {device.type} Triton only interprets its kernels, so this run checks them against the "
              f"PyTorch path on small sizes {CPU_SIZES} and produces no speed figure.")
    from machine import base_info

    from fivefold.kernels import triton_available

    if not triton_available():
        sys.exit("Triton cannot run here; install triton (pip install 'triton>=3.1') and run on a CUDA GPU")
    import triton

    dtype = DTYPES[args.dtype]
    paths = ["compiled", "triton"] if on_gpu else ["triton"]
    cases = make_cases(args, device, dtype, compile_torch=on_gpu)
    for case in cases:
        check(case, paths)
        print(f"{case.name}: largest difference from eager, relative to its largest value: "
              + ", ".join(f"{path} {diff:.1e}" for path, diff in case.check.items()), flush=True)
    if on_gpu:
        for case in cases:
            time_paths(case, ["eager"] + paths, args)
        sizes = f"tokens {args.batch * args.seq} ({args.batch} x {args.seq}), hidden {args.hidden}, " \
                f"ffn {args.ffn}, {args.heads} heads x {args.head_dim}"
        print(f"\n{torch.cuda.get_device_name(device)}, {args.dtype}, {sizes}: forward + backward, median of "
              f"{args.repeats} windows of {args.iters} steps")
        print_table(cases)
        try:  # after the kernels' table: an attention backend's failure must not lose it
            attention = time_attention(args, device, dtype)
        except Exception as e:  # noqa: BLE001  (reported and stored, whatever it is)
            print(f"attention backends: not timed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            attention = {"error": f"{type(e).__name__}: {e}"[:500]}
    else:
        print("no speed figure: interpreter times are meaningless (run with --device cuda on a GPU).")
    out = {"machine": {**base_info(), "device": torch.cuda.get_device_name(device) if on_gpu else device.type,
                       "triton": triton.__version__},
           "args": vars(args),
           "results": [{"kernel": c.name, "ms": c.ms or None, "min_bytes": c.min_bytes,
                        "rel_diff_from_eager": c.check,
                        "triton_over_eager": c.ms["triton"] / c.ms["eager"] if c.ms else None,
                        "triton_over_compiled": c.ms["triton"] / c.ms["compiled"] if c.ms else None}
                       for c in cases],
           "attention_backends": attention}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
