"""fivefold's C++ CPU kernels at two versions, loaded in one process and timed in turn: this checkout's build
against a git revision's (the sources of fivefold/kernels/ at --base, built once into their own directory). This
shared host's speed moves by tens of percent between runs (bench/serve.py's batch-1 decode read 69 and 105 tok/s
within an hour), so a kernel change is judged by rounds that alternate the two builds, the best of each kept.
Each call runs over copies of its weights or pools, --bytes of them (more than the caches hold, as a served
model's 30 layers are), so that what is timed is streaming from memory, not reading a cache; and the copies lie
in transparent huge pages where the kernel offers them, as the engine puts its weights and KV pool
(fivefold.serve.huge_pages).

Times the paged decode attention (smollm2-135m's 9 query heads on 3 key/value heads of 64, 16-token blocks) at
1 row of 200 and 600 tokens and 8 and 32 rows of 300, and the rows kernel over smollm2-135m's product shapes (its
fused q/k/v, o, gate/up, down, the LM head) at 1, 4, 16 and 32 rows, in float32 and bfloat16.

    python bench/cpu_kernels_ab.py --base 914ea93 [--rounds 15] [--json bench/results/cpu_kernels_ab.json]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import time
from pathlib import Path

import torch
from torch import nn
from cpu_linear_rows import shapes
from cpu_paged_decode import case_args
from machine import base_info, write_results

from fivefold.kernels import cpu_build
from fivefold.serve.huge_pages import huge_pages_available, move_to_huge_pages

ROOT = Path(__file__).resolve().parent.parent
ATTENTION = [(1, 200), (1, 600), (8, 300), (32, 300)]  # rows, context tokens
ROWS = [1, 4, 16, 32]


def build_at(revision: str):
    """The CPU kernels as they were at `revision`, built into a directory named by their sources' hash (this
    checkout's build where they are the same)."""
    files = {f.name: subprocess.run(["git", "show", f"{revision}:fivefold/kernels/{f.name}"], cwd=ROOT, check=True,
                                    capture_output=True).stdout for f in cpu_build.SOURCES + cpu_build.HEADERS}
    if all(files[f.name] == f.read_bytes() for f in cpu_build.SOURCES + cpu_build.HEADERS):
        print(f"the kernels at {revision} are this checkout's", flush=True)
        return cpu_build.build()[0]
    digest = hashlib.sha256(b"".join(files[name] for name in sorted(files))).hexdigest()[:10]
    build_dir = cpu_build.build_directory().parent / f"fivefold_cpu_kernels_ab_{digest}"
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for file, data in files.items():
        if not (src / file).is_file() or (src / file).read_bytes() != data:
            (src / file).write_bytes(data)
    print(f"the kernels at {revision}: {build_dir}", flush=True)
    return cpu_build.compile_sources(src, build_dir)


def copies(nbytes: int, total: float) -> int:
    return max(2, min(256, int(total // nbytes)))


def resident(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors moved into one mapping advised for huge pages, as the engine moves its weights
    (fivefold.serve.huge_pages.move_to_huge_pages), where the kernel offers them; else as they are."""
    if not huge_pages_available():
        return tensors
    holder = nn.Module()
    for i, t in enumerate(tensors):
        holder.register_buffer(f"t{i}", t)
    move_to_huge_pages(holder)
    return [getattr(holder, f"t{i}") for i in range(len(tensors))]


def best_in_turn(calls: dict, rounds: int, reps: int) -> dict:
    """Each side's best time a call over `rounds` rounds that run the sides one after the other."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for side, call in calls.items():
            start = time.perf_counter()
            for _ in range(reps):
                call()
            best[side] = min(best[side], (time.perf_counter() - start) / reps)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare this checkout's kernels against")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--only", choices=["attention", "rows"], default="", help="time one kernel only")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--bytes", type=float, default=256e6, help="weights or pools per call, in bytes")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    head, why = cpu_build.build()
    if head is None:
        raise SystemExit(f"the CPU kernels cannot be built here: {why}")
    sides = {"base": build_at(args.base), "this": head}
    out = {**base_info(), "base": args.base, "attention": [], "rows": []}
    print(f"time this / time at {args.base} (below 1: this checkout is faster)")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for rows, tokens in ATTENTION if args.only != "rows" else []:
            q, k, v, tables, lens = (t.to(dtype) if t.is_floating_point() else t for t in case_args(rows, tokens))
            flat = resident([t.clone() for _ in range(copies(2 * k.nbytes, args.bytes)) for t in (k, v)])
            pools = list(zip(flat[::2], flat[1::2]))
            splits = 3 if rows < 2 * torch.get_num_threads() else 1  # as the engine chooses (decode_splits)

            def attention(m):
                for kp, vp in pools:
                    m.decode_attention(q, kp, vp, tables, lens, 0.125, splits, False)
            best = best_in_turn({s: (lambda m=m: attention(m)) for s, m in sides.items()}, args.rounds, 2)
            out["attention"].append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "tokens": tokens,
                                     "us": {s: t * 1e6 for s, t in best.items()}, "ratio": best["this"] / best["base"]})
            print(f"decode attention, {dtype}, {rows} rows of {tokens}: {best['base'] * 1e6:.0f} -> "
                  f"{best['this'] * 1e6:.0f} us ({best['this'] / best['base']:.3f})", flush=True)
        for name, (n, k) in shapes("smollm2-135m").items() if args.only != "attention" else []:
            weights = resident([torch.randn(n, k).to(dtype) for _ in range(copies(n * k * dtype.itemsize, args.bytes))])
            for rows in ROWS:
                x = torch.randn(rows, k).to(dtype)

                def product(m):
                    for w in weights:
                        m.linear_rows(x, w, 0)
                best = best_in_turn({s: (lambda m=m: product(m)) for s, m in sides.items()}, args.rounds, 2)
                out["rows"].append({"dtype": str(dtype).removeprefix("torch."), "shape": name, "rows": rows,
                                    "us": {s: t * 1e6 for s, t in best.items()}, "ratio": best["this"] / best["base"]})
            line = " ".join(f"{r['rows']}: {r['ratio']:.3f}" for r in out["rows"][-len(ROWS):])
            print(f"rows kernel, {dtype}, {name} ({n} x {k}), by rows: {line}", flush=True)
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
