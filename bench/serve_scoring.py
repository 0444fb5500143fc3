"""Prompt scoring (SamplingParams.prompt_logprobs): the engine against transformers' forward, same weights.

One seeded set of prompts, all scored at once: every token's logprob given the tokens before it, and the
k likeliest tokens in its place.
- **fivefold**: `LLM(model).generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=k))`, the serving
  engine's chunked prefill with the scored rows through the LM head;
- **fivefold, prefill only**: the same prompts with one greedy token and no scores (what scoring adds);
- **transformers**: `LlamaForCausalLM` over right-padded batches of the prompts, then the log-softmax, the
  gather of each next token and the top-k: what an evaluation harness's `hf` model does. Every batch size in
  --batch-sizes is tried and the best is the reference.

Printed: each side's scored tokens per second and the ratios, and the largest difference between the two
sides' logprobs (the check that they score the same thing).

    python bench/serve_scoring.py --json bench/results/serve_scoring_cpu.json   # smollm2-135m, fp32, CPU
    python bench/serve_scoring.py --model tiny --prompts 8                      # a quick check
"""

from __future__ import annotations

import argparse
import time

import torch

from fivefold.serve import LLM, SamplingParams
from machine import base_info, write_results
from serve import build_models


def prompts_of(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_scores(hf, prompts: list[list[int]], batch: int, k: int) -> list[list[float]]:
    """Each prompt's next-token logprobs by transformers, in right-padded batches (padding is masked out, and
    a right-padded row's real tokens never attend to it)."""
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, p in enumerate(group):
            ids[row, :len(p)], mask[row, :len(p)] = torch.tensor(p), 1
        logprobs = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
        chosen = logprobs.gather(2, ids[:, 1:, None])[..., 0]
        logprobs.topk(k, dim=-1)  # the harness's greedy check reads the top tokens too
        out += [chosen[row, :len(p) - 1].tolist() for row, p in enumerate(group)]
    return out


def timed(fn, reps: int):
    """The fastest of `reps` runs (outside load only slows a run), and the last result."""
    best, result = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--shortest", type=int, default=64)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--top", type=int, default=1, help="k likeliest tokens per position (lm-eval asks 1)")
    parser.add_argument("--batch-sizes", default="1,4,8,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 2 <= args.shortest <= args.longest:
        parser.error(f"--shortest {args.shortest} and --longest {args.longest}: need 2 <= shortest <= longest")

    torch.set_num_threads(torch.get_num_threads())
    cfg, ours, hf = build_models(args.model, args.seed, torch.float32, skip_hf=False)
    prompts = prompts_of(args.prompts, args.shortest, args.longest, cfg.vocab_size, args.seed)
    tokens = sum(len(p) - 1 for p in prompts)
    llm = LLM(ours, prefix_cache=False)  # else each repetition would find the last one's prompts cached
    llm.generate(prompts[:2], SamplingParams(max_tokens=0, prompt_logprobs=args.top))  # warm-up
    score = SamplingParams(max_tokens=0, prompt_logprobs=args.top)
    seconds, outs = timed(lambda: llm.generate(prompts, score), args.reps)
    prefill, _ = timed(lambda: llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0)), args.reps)
    ours_lp = [[e["logprob"] for e in o.prompt_logprobs[1:]] for o in outs]
    hf_rows = {}
    for b in map(int, args.batch_sizes.split(",")):
        hf_rows[b], reference = timed(lambda: hf_scores(hf, prompts, b, max(args.top, 1)), args.reps)
    best = min(hf_rows, key=hf_rows.get)
    diff = max(abs(a - b) for x, y in zip(ours_lp, reference) for a, b in zip(x, y))
    figures = {**base_info(), "model": args.model, "prompts": args.prompts, "scored_tokens": tokens,
               "prompt_lengths": [args.shortest, args.longest], "top": args.top,
               "fivefold_s": round(seconds, 3), "fivefold_prefill_only_s": round(prefill, 3),
               "transformers_s_by_batch": {b: round(s, 3) for b, s in hf_rows.items()}, "transformers_best_batch": best,
               "fivefold_tok_s": round(tokens / seconds), "transformers_tok_s": round(tokens / hf_rows[best]),
               "speedup": round(hf_rows[best] / seconds, 2), "scoring_overhead": round(seconds / prefill - 1, 3),
               "max_abs_logprob_diff": diff}
    print(f"{args.prompts} prompts of {args.shortest}-{args.longest} tokens, {tokens:,} scored, {args.model} fp32:")
    print(f"  fivefold:      {seconds:.2f} s, {tokens / seconds:,.0f} tok/s (prefill alone {prefill:.2f} s: "
          f"scoring adds {100 * (seconds / prefill - 1):.1f}%)")
    print(f"  transformers:  {hf_rows[best]:.2f} s at batch {best}, {tokens / hf_rows[best]:,.0f} tok/s "
          f"(by batch: {', '.join(f'{b}: {s:.2f} s' for b, s in hf_rows.items())})")
    print(f"  fivefold / transformers: {hf_rows[best] / seconds:.2f}x; largest logprob difference {diff:.1e}")
    if args.json:
        write_results(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
