"""A decode step's attention core on this CPU, on the calls `bench/serve.py`'s default workload makes: the
query heads that share a key/value head run as that head's query rows (fivefold/model/attention.py) against
one query row per head (SDPA's grouped-query path, what the core did before).

The workload runs once through the engine while a sample of its one-token attention calls (their q, the
gathered keys and values, the mask) is copied; then both forms run over exactly those inputs, in turns, each
call after a 32 MB sum that evicts the caches as the products between two layers' attention do. Both forms
give the same result (tested in float64, tests/test_model.py).

    python bench/serve_decode_attention.py --json bench/results/serve_decode_attention.json   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch
from machine import base_info, write_results

import serve as serve_bench
from serve_cpu_ab import one_row_per_head
from fivefold.model.attention import AttentionCore


def record_calls(sample: float, seed: int) -> list[tuple]:
    """(core, q, k, v, mask) of a `sample` fraction of the default workload's one-token attention calls."""
    args = serve_bench.parse_args(["--skip-hf"])
    cfg, model, _ = serve_bench.build_models(args.model, args.seed, torch.float32, True)
    requests = serve_bench.make_requests(args.requests, cfg.vocab_size, (args.min_prompt, args.max_prompt),
                                         (args.min_output, args.max_output), args.seed, args.output_dist)
    llm = serve_bench.make_llm(model, args, requests)
    rng, calls, forward = random.Random(seed), [], AttentionCore.forward

    def recording(self, q, k, v, mask):
        if q.shape[2] == 1 and mask is not None and rng.random() < sample:
            calls.append((self, q.clone(), k.clone(), v.clone(), mask.clone()))
        return forward(self, q, k, v, mask)

    AttentionCore.forward = recording
    try:
        serve_bench.run_fivefold(llm, requests)
    finally:
        AttentionCore.forward = forward
    return calls


def per_call_us(calls: list[tuple], evict: torch.Tensor) -> float:
    """AttentionCore.forward as it is now (the form's context sets it) over the calls, each after `evict`."""
    total = 0.0
    for core, *inputs in calls:
        evict.sum()
        forward = AttentionCore.forward
        start = time.perf_counter()
        forward(core, *inputs)
        total += time.perf_counter() - start
    return total / len(calls) * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", type=float, default=0.05, help="fraction of the one-token calls copied")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    calls = record_calls(args.sample, seed=0)
    evict = torch.randn(8 * 2**20)
    forms = {"row per head": one_row_per_head, "heads as rows": contextlib.nullcontext}
    times = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, form in forms.items():
            with form():
                times[name].append(per_call_us(calls, evict))
    rows = [call[1].shape[0] for call in calls]
    keys = [call[2].shape[2] for call in calls]
    print(f"{len(calls)} one-token attention calls of the default workload: {min(rows)}-{max(rows)} sequences, "
          f"{min(keys)}-{max(keys)} keys (median {statistics.median(keys):.0f})")
    for name, xs in times.items():
        print(f"  {name:<14}: {min(xs):.0f} us a call best, {statistics.median(xs):.0f} median")
    ratio = statistics.median(times["row per head"]) / statistics.median(times["heads as rows"])
    print(f"  heads as rows: {ratio:.2f}x faster (medians)")
    result = {"machine": base_info(), "calls": len(calls), "sequences": [min(rows), max(rows)],
              "keys": [min(keys), max(keys)], "us_per_call": times, "speedup_median": ratio}
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
