"""fivefold's rows kernel (fivefold/kernels/cpu_linear_rows.py) against the libraries' float32 (or, with --dtype
bfloat16, bfloat16) products on this CPU, over a model's linear shapes at a decode's row counts: MKL's (F.linear) and oneDNN's, each over the
weight's plain (out, in) layout and its input-major one, the kernel over the plain one (the only one it
reads). Each product runs over --bytes of copies of the weight (more than the caches hold, as a served
model's weights are), best of --reps rounds; the table gives the weights' read rate (GB/s) and the kernel's
speed-up over the fastest library product at each row count.

    python bench/cpu_linear_rows.py [--model smollm2-135m] [--width 256] [--json bench/results/cpu_linear_rows.json]
    python bench/cpu_linear_rows.py --dtype bfloat16 --json bench/results/cpu_linear_rows_bf16_dot_amd.json

In bfloat16 on a CPU with AVX512_BF16 the table also gives the kernel's widening form ("rows kernel, rows widened":
the rows widened to float32, then the tiles that widen each weight as loaded), the form other CPUs run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from machine import base_info, write_results

from fivefold.kernels import cpu_build
from fivefold.kernels.cpu_linear_rows import MAX_ROWS_BY_WIDTH, rows_kernel_problem
from fivefold.presets import get_preset
from fivefold.serve.cpu_linear import input_major, onednn_available, onednn_linear, rows_kernel_all


WIDENED = "rows kernel, rows widened"


def shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each distinct product of a served model: fused q/k/v, o, fused gate/up, down, LM head."""
    c = get_preset(name)
    d = c.head_size
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * d, c.hidden_size), "o": (c.hidden_size, c.num_heads * d),
            "gate_up": (2 * c.ffn_hidden_size, c.hidden_size), "down": (c.hidden_size, c.ffn_hidden_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def seconds(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    """Best over `reps` rounds of one product's mean time over the weights."""
    fn(x, weights[0])
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a preset whose linear shapes to time")
    p.add_argument("--rows", default="1,2,4,8,16,24,32")
    p.add_argument("--bytes", type=float, default=256e6, help="weight copies per shape, in bytes (beyond the caches)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--width", type=int, default=0, choices=[0, 256],
                   help="the kernel's tiles: 0 the widest built (AVX-512 where the CPU has it), 256 the AVX2 ones")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' and rows' dtype (a bfloat16 engine's: the kernel widens them as it reads)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    why = rows_kernel_problem()
    if why:
        raise SystemExit(f"the rows kernel cannot run here: {why}")
    torch.set_grad_enabled(False)

    def kernel(x, w):  # the AVX2 tiles at the rows the wrapper would give them on an AVX2 machine, else MKL's
        return cpu_build.build()[0].linear_rows(x, w, args.width) \
            if x.shape[0] <= MAX_ROWS_BY_WIDTH[256] else F.linear(x, w)
    rows = [int(r) for r in args.rows.split(",")]
    products = {"F.linear plain": (F.linear, False), "F.linear input-major": (F.linear, True)}
    if onednn_available():
        products |= {"oneDNN plain": (onednn_linear, False), "oneDNN input-major": (onednn_linear, True)}
    module = cpu_build.build()[0]
    width = args.width or module.linear_rows_width()
    # Where bfloat16 rows multiply as bfloat16 pairs (AVX512_BF16), the kernel's earlier form beside it: the rows
    # widened to float32 first, then the same tiles with the weights widened as loaded.
    widened = dtype == torch.bfloat16 and not args.width and module.bf16_pairs()
    result = {**base_info(), "model": args.model, "dtype": args.dtype, "rows": rows, "kernel_width": width,
              "shapes": {}}
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, the kernel's {width}-bit tiles: GB/s of "
          f"weights read; kernel / best library")
    for name, (out, inp) in shapes(args.model).items():
        nbytes = out * inp * dtype.itemsize
        copies = max(2, min(64, int(args.bytes // nbytes)))
        plain = [torch.randn(out, inp).to(dtype) for _ in range(copies)]
        laid = [input_major(w) for w in plain]
        table = {}
        for m in rows:
            x = torch.randn(m, inp).to(dtype)
            times = {label: seconds(fn, x, laid if major else plain, args.reps)
                     for label, (fn, major) in products.items()}
            times["rows kernel"] = seconds(kernel, x, plain, args.reps) if args.width else \
                seconds(rows_kernel_all, x, plain, args.reps)
            if widened:
                times[WIDENED] = seconds(lambda a, w: module.linear_rows(a.float(), w, 0).to(dtype), x, plain, args.reps)
            best_library = min(v for k, v in times.items() if k not in ("rows kernel", WIDENED))
            table[m] = {"gb_per_s": {k: nbytes / v / 1e9 for k, v in times.items()},
                        "speedup_over_best_library": best_library / times["rows kernel"]}
        result["shapes"][name] = {"out": out, "in": inp, "copies": copies, "by_rows": table}
        line = " ".join(f"{m}: {t['gb_per_s']['rows kernel']:.0f} vs "
                        f"{max(v for k, v in t['gb_per_s'].items() if k not in ('rows kernel', WIDENED)):.0f} "
                        f"({t['speedup_over_best_library']:.2f}x"
                        + (f"; widened {t['gb_per_s'][WIDENED]:.0f}" if widened else "") + ")"
                        for m, t in table.items())
        print(f"{name} ({out} x {inp}): {line}")
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
