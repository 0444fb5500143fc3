"""The CPU engine's weight layout, A/B in one process: block weights laid out input-major where oneDNN runs
them faster (fivefold/serve/cpu_linear.py, `input_major_pays`) against the plain layout.

Two engines on the same random-weight model, differing only in layout (`serve.linear=auto` both), run
alternately, so that whatever the host does to one it does to the other: batch-1 decode tok/s, and output
tok/s of a batch of requests decoding together. On a host whose speed moves between processes (this
project's 2-vCPU machine reads memory at 39-46 GB/s in some and 68-74 in others), only a comparison inside
one process says what a change is worth.

    python bench/serve_layout_ab.py --json bench/results/serve_layout_ab.json     # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from machine import write_results

from fivefold.model import build_model
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.cpu_linear import use_onednn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a preset (random weights, fp32)")
    p.add_argument("--reps", type=int, default=6, help="alternating runs of each side")
    p.add_argument("--requests", type=int, default=16, help="requests decoding together in the batch run")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def make_llm(cfg, input_major: bool) -> LLM:
    """An engine whose block weights take the timed layout choice, or stay plain."""
    chosen = use_onednn.__defaults__
    if not input_major:
        use_onednn.__defaults__ = (lambda shape, dtype: False,)
    try:
        return LLM(build_model(cfg, "cpu", seed=0).eval(), device="cpu", seed=0, num_blocks=400, max_num_seqs=64)
    finally:
        use_onednn.__defaults__ = chosen


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = get_preset(args.model)
    llms = {"input-major": make_llm(cfg, True), "plain": make_llm(cfg, False)}
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.path}")
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = list(range(100, 228))
    rng = random.Random(0)
    batch1 = {name: [] for name in llms}
    batch = {name: [] for name in llms}
    for _ in range(args.reps):
        prompts = [[rng.randrange(1, cfg.vocab_size) for _ in range(64)] for _ in range(args.requests)]
        for name, llm in llms.items():
            out = llm.generate([prompt], SamplingParams(max_tokens=64, **greedy))[0]
            batch1[name].append(1 / out.tpot)
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=48, **greedy))
            batch[name].append(args.requests * 48 / (time.perf_counter() - start))
    result = {"model": args.model, "threads": torch.get_num_threads(), "reps": args.reps,
              "requests": args.requests, "paths": {n: llm.engine.path for n, llm in llms.items()}}
    for label, runs in (("batch1_decode_tok_s", batch1), (f"batch{args.requests}_output_tok_s", batch)):
        summary = {n: {"runs": xs, "best": max(xs), "median": statistics.median(xs)} for n, xs in runs.items()}
        summary["gain_best"] = summary["input-major"]["best"] / summary["plain"]["best"] - 1
        summary["gain_median"] = summary["input-major"]["median"] / summary["plain"]["median"] - 1
        result[label] = summary
        print(f"{label}: plain best {summary['plain']['best']:.1f} median {summary['plain']['median']:.1f}; "
              f"input-major best {summary['input-major']['best']:.1f} median {summary['input-major']['median']:.1f}; "
              f"gain {100 * summary['gain_best']:+.1f}% (best) {100 * summary['gain_median']:+.1f}% (median)")
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
