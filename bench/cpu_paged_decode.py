"""The CPU decode-attention kernel (fivefold/kernels/cpu_paged_decode.py) in its two forms, in one process:
this CPU's (AVX-512's transposed sums where it has them) and the portable one a CPU without AVX-512 compiles
(one dot product a key), on smollm2-135m's heads (9 query heads on 3 key/value heads of 64) over a paged pool
of 16-token blocks, at 1 and 8 rows of 192 and 600 tokens. Alternating rounds, the best of each kept:

    python bench/cpu_paged_decode.py [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
from machine import base_info, us_per_call, write_results

from fivefold.kernels.cpu_paged_decode import decode_attention, kernel_problem

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(1, 192), (8, 192), (1, 600), (8, 600)]  # rows, context tokens


def case_args(rows: int, tokens: int, seed: int = 0) -> tuple:
    """The kernel's arguments: each row's blocks scattered over a pool of random keys and values."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-tokens // BLOCK)
    pool = torch.randn(rows * per_row + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    values = torch.randn(pool.shape, generator=gen)
    tables = (torch.randperm(rows * per_row, generator=gen) + 1).view(rows, per_row).to(torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    return q, pool, values, tables, torch.full((rows,), tokens, dtype=torch.int32)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if kernel_problem():
        raise SystemExit(f"the CPU decode kernel cannot run here: {kernel_problem()}")
    forms = {"native": lambda *a: decode_attention(*a), "portable": lambda *a: decode_attention(*a, portable=True)}
    rows = []
    for n, tokens in CASES:
        arguments = case_args(n, tokens)
        torch.testing.assert_close(forms["native"](*arguments), forms["portable"](*arguments), rtol=1e-5, atol=1e-5)
        best = {name: float("inf") for name in forms}
        for _ in range(args.rounds):
            for name, us in us_per_call(forms, *arguments, reps=args.reps).items():
                best[name] = min(best[name], us)
        row = {"rows": n, "tokens": tokens, "native_us": best["native"], "portable_us": best["portable"],
               "native_speedup": best["portable"] / best["native"]}
        rows.append(row)
        print(f"{n} rows x {tokens:4d} tokens   native {row['native_us']:7.1f} us   portable "
              f"{row['portable_us']:7.1f} us   native {row['native_speedup']:.2f}x", flush=True)
    result = {"machine": base_info(), "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
