"""Top-k / top-p filtering (fivefold.serve.sampling.filtered_probs) against transformers' warpers, and the
engine's decoding with top-p, on the same logits in one process.

The filters' definition needs each row's tokens in order of likelihood. A full sort of a 49K vocabulary is
slow on a CPU (~10 ms a row on 2 vCPUs), so on a CPU fivefold looks for the nucleus among the 256 likeliest
tokens first (one top-k) and sorts whole only the rows whose nucleus reaches past them. How often that is
depends on how peaked the model's distributions are, so the logits here are a trained model's where one is
given (`--run`), and each row's nucleus size is reported.

- **filters**: the rows of logits the run's model gives along its own sampled text (or random logits at two
  spreads without --run), filtered with temperature 1, top-p `--top-p` (and top-k 50 on a second pass):
  fivefold as it runs (candidates first), fivefold sorting every row (`candidates=0`, how it ran before), and
  transformers' `TopPLogitsWarper` / `TopKLogitsWarper` then the softmax. The kept sets are compared.
- **engine**: `LLM(run).generate` of `--requests` prompts with top-p, candidates first against every row
  sorted: the tokens (the same seeds) and the time.
- **draws** (`--draw-rows`, `--draw-vocab`; default 256 x 128,256, Llama 3's vocabulary at a GPU batch): the
  whole draw (`launch_sampling`) of flat random logits at top-p 0.9, every row drawn and sorted whole, in one
  pass and `draw_rows()` rows at a time (DRAW_BUDGET): the peak of the memory it allocates beside the logits
  (measured op by op, fivefold.memory.live_peak), the time, the tokens, and the working set `fivefold plan
  --serve` counts for it (no logprobs or biases here, which it counts beside).

    python bench/serve_sampling.py --run runs/default --json bench/results/serve_sampling_cpu.json
    python bench/serve_sampling.py                                    # random logits only, a quick check
    python bench/serve_sampling.py --draw-rows 256 --draw-vocab 128256   # + the draws, ~1 min on 2 vCPUs
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

import fivefold.serve.sampling as sampling
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.sampling import filtered_probs
from fivefold.memory.live_peak import LivePeak
from fivefold.serve.batch import SlotParams
from fivefold.serve.step_memory import SMALL
from machine import base_info, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="a trained fivefold run or checkpoint (its logits; default: random logits)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--rows", type=int, default=64, help="rows of logits filtered at once")
    p.add_argument("--vocab", type=int, default=49152, help="without --run: the random logits' vocabulary")
    p.add_argument("--requests", type=int, default=8, help="engine: requests decoded together")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--draw-rows", type=int, default=0, help="draws: rows of logits (0: skip the draws)")
    p.add_argument("--draw-vocab", type=int, default=128256, help="draws: their vocabulary")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="draws: where they run")
    p.add_argument("--draw-budget-mib", type=float, default=sampling.DRAW_BUDGET / 2**20,
                   help="draws: DRAW_BUDGET for the chunked side (default: fivefold's)")
    p.add_argument("--json")
    return p.parse_args(argv)


def best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def transformers_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = logits
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    return TopPLogitsWarper(top_p)(None, scores).softmax(dim=-1)


@torch.inference_mode()
def run_logits(llm: LLM, rows: int, seed: int) -> torch.Tensor:
    """The model's logits at each position of texts it samples itself (temperature 1), `rows` of them: the
    distributions a sampler meets when serving it."""
    params = SamplingParams(max_tokens=rows, temperature=1.0, seed=seed, ignore_eos=True)
    out = llm.generate([[llm.engine.eos_id or 0]], params)[0]
    ids = torch.tensor([[llm.engine.eos_id or 0] + out.token_ids])
    return llm.engine.model(ids)[0, :rows].float()


def filters(logits: torch.Tensor, top_p: float, reps: int) -> list[dict]:
    n = logits.shape[0]
    one, zeros = torch.ones(n), torch.zeros(n)
    rows = []
    for top_k in (0, 50):
        k, p = torch.full((n,), top_k), torch.full((n,), top_p)
        ours = filtered_probs(logits, one, k, p, zeros)
        sorted_all = filtered_probs(logits, one, k, p, zeros, candidates=0)
        ref = transformers_filter(logits, top_k, top_p)
        kept = (ours > 0).sum(-1)
        row = {"top_k": top_k, "top_p": top_p, "rows": n,
               "nucleus_median": int(kept.median()), "nucleus_max": int(kept.max()),
               "rows_past_candidates": int((kept > sampling.NUCLEUS_CANDIDATES).sum()),
               "same_kept_as_sorting_all": bool(torch.equal(ours > 0, sorted_all > 0)),
               "rows_kept_as_transformers": int(((ours > 0) == (ref > 0)).all(-1).sum()),
               "fivefold_ms": 1e3 * best_time(lambda: filtered_probs(logits, one, k, p, zeros), reps),
               "sorting_all_ms": 1e3 * best_time(lambda: filtered_probs(logits, one, k, p, zeros, candidates=0), reps),
               "transformers_ms": 1e3 * best_time(lambda: transformers_filter(logits, top_k, top_p), reps)}
        rows.append(row)
        print(f"top-k {top_k:>2}, top-p {top_p}: {n} rows, nucleus median {row['nucleus_median']} max "
              f"{row['nucleus_max']} ({row['rows_past_candidates']} past {sampling.NUCLEUS_CANDIDATES}); "
              f"fivefold {row['fivefold_ms']:.2f} ms, sorting every row {row['sorting_all_ms']:.2f} ms "
              f"({row['sorting_all_ms'] / row['fivefold_ms']:.1f}x), transformers {row['transformers_ms']:.2f} ms "
              f"({row['transformers_ms'] / row['fivefold_ms']:.1f}x); kept sets: as sorting every row "
              f"{row['same_kept_as_sorting_all']}, as transformers in {row['rows_kept_as_transformers']} of {n} rows",
              flush=True)
    return rows


def engine(llm: LLM, args) -> dict:
    prompts = [[llm.engine.eos_id or 0, 5 + i] for i in range(args.requests)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p, seed=i, ignore_eos=True)
              for i in range(args.requests)]
    out = {}
    for name, candidates in (("candidates", sampling.NUCLEUS_CANDIDATES), ("sorting_all", 0)):
        saved, sampling.NUCLEUS_CANDIDATES = sampling.NUCLEUS_CANDIDATES, candidates
        try:
            llm.generate(prompts[:1], params[:1])  # warm
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            out[name] = {"s": time.perf_counter() - start, "tokens": [o.token_ids for o in outs]}
        finally:
            sampling.NUCLEUS_CANDIDATES = saved
    tokens = args.requests * args.max_tokens
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "top_p": args.top_p,
              "candidates_s": out["candidates"]["s"], "sorting_all_s": out["sorting_all"]["s"],
              "same_tokens": out["candidates"]["tokens"] == out["sorting_all"]["tokens"]}
    print(f"engine, {args.requests} requests x {args.max_tokens} tokens at top-p {args.top_p}: candidates first "
          f"{result['candidates_s']:.2f} s ({tokens / result['candidates_s']:.0f} tok/s), sorting every row "
          f"{result['sorting_all_s']:.2f} s ({tokens / result['sorting_all_s']:.0f} tok/s): "
          f"{result['sorting_all_s'] / result['candidates_s']:.2f}x; same tokens: {result['same_tokens']}", flush=True)
    return result


def draws(rows: int, vocab: int, top_p: float, reps: int, budget: int, device: str = "cpu") -> dict:
    """launch_sampling of `rows` flat rows, all drawn at top-p: one pass against draw_rows() at a time."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    f32 = lambda x: np.full(rows, x, dtype=np.float32)  # noqa: E731
    params = SlotParams(f32(1.0), np.zeros(rows, dtype=np.int64), f32(top_p), f32(0.0), f32(1.0), f32(0.0), f32(0.0),
                        np.zeros(rows, dtype=bool), np.random.default_rng(0).random(rows, dtype=np.float32))
    requests = [SimpleNamespace(params=SamplingParams(temperature=1.0, top_p=top_p), prompt_ids=[], output_ids=[])
                for _ in range(rows)]
    out = {"rows": rows, "vocab": vocab, "top_p": top_p, "draw_bytes": sampling.DRAW_BYTES, "device": device}
    for name, budget in (("one_pass", 1 << 62), ("chunked", budget)):
        saved, sampling.DRAW_BUDGET = sampling.DRAW_BUDGET, budget
        try:
            with LivePeak() as peak:
                tokens = sampling.launch_sampling(logits, params, requests).result()[0]
            seconds = best_time(lambda: sampling.launch_sampling(logits, params, requests).result(), reps)
            out[name] = {"rows_at_once": min(rows, sampling.draw_rows(vocab)), "peak_bytes": peak.peak,
                         "planned_bytes": min(rows, sampling.draw_rows(vocab)) * vocab * sampling.DRAW_BYTES + SMALL,
                         "s": seconds, "tokens": tokens}
        finally:
            sampling.DRAW_BUDGET = saved
    out["same_tokens"] = out["one_pass"]["tokens"] == out["chunked"]["tokens"]
    one, chunked = out["one_pass"], out["chunked"]
    print(f"draws, {rows} rows x {vocab:,} (flat, top-p {top_p}): one pass peak {one['peak_bytes'] / 2**20:,.0f} MiB "
          f"(planned {one['planned_bytes'] / 2**20:,.0f}), {one['s'] * 1e3:.0f} ms; {chunked['rows_at_once']} rows at a "
          f"time peak {chunked['peak_bytes'] / 2**20:,.0f} MiB (planned {chunked['planned_bytes'] / 2**20:,.0f}), "
          f"{chunked['s'] * 1e3:.0f} ms ({chunked['s'] / one['s']:.2f}x the time); same tokens: {out['same_tokens']}",
          flush=True)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    out = {**base_info(), "run": args.run, "candidates": sampling.NUCLEUS_CANDIDATES, "filters": {}}
    if args.run:
        llm = LLM(args.run, device="cpu")
        logits = run_logits(llm, args.rows, seed=0)
        print(f"{args.run}: logits of {args.rows} positions of its own sampled text, vocabulary {logits.shape[-1]:,}")
        out["filters"]["run"] = filters(logits, args.top_p, args.reps)
        out["engine"] = engine(llm, args)
    g = torch.Generator().manual_seed(0)
    for spread, scale in (("peaked", 6.0), ("flat", 1.0)):  # random logits x scale: a few tokens, or most
        logits = torch.randn(args.rows, args.vocab, generator=g) * scale
        print(f"random logits x {scale} ({spread}), vocabulary {args.vocab:,}")
        out["filters"][spread] = filters(logits, args.top_p, args.reps)
    if args.draw_rows:
        out["draws"] = draws(args.draw_rows, args.draw_vocab, args.top_p, min(args.reps, 3),
                             int(args.draw_budget_mib * 2**20), args.device)
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
