"""The CPU engine's choices, A/B in one process: each against the engine without it.

- `products`: each linear's product chosen per shape among oneDNN's and F.linear's, each in both layouts
  (fivefold/serve/cpu_linear.py, serve.linear=auto) against oneDNN's alone (serve.linear=onednn);
- `layout`: block weights laid out input-major where the chosen product runs them faster
  (`chosen_product`) against the plain layout;
- `lean`: the blocks as one loop of tensor ops (fivefold/serve/lean_forward.py, serve.fuse_launches=true)
  against the model's modules step by step;
- `huge-pages`: weights and KV pool in transparent huge pages (fivefold/serve/huge_pages.py,
  serve.huge_pages=true) against 4 KiB pages;
- `heads-as-rows`: a decode step's attention with the query heads that share a key/value head as that head's
  query rows (fivefold/model/attention.py) against one query row per head (SDPA's grouped-query path);
- `lm-head`: the LM head's product as chosen (at 1, 4, 8 and 16 rows) against F.linear's (what timing at 1 and
  16 rows alone chose on the Intel host); run it with `--requests 8`, where the two differ;
- `cpu-kernel`: decodes attending through the C++ kernel that reads the KV pool in place
  (fivefold/kernels/cpu_paged_decode.py, serve.cpu_kernel=true) against gathering their blocks for SDPA;
- `block-ops`: under serve.cpu_kernel, the lean loop's norms (with the residual add before each) and a
  decode-only step's RoPE + KV store + attention as one C++ call each (fivefold/kernels/cpu_block_ops.py)
  against torch's ops for them (the attention kernel on both sides);
- `one-call`: a decode-only step's blocks as one C++ call where C++ can run all their products (the rows kernel,
  F.linear's; fivefold.kernels.cpu_block_ops.decode_blocks) against the same ops called one by one from Python;
- `rows-kernel`: linears at 4-32 rows through fivefold's rows kernel where it was timed faster for their shape
  (fivefold/kernels/cpu_linear_rows.py, among serve.linear=auto's candidates) against the libraries' products;
- `one-row`: the rows kernel's one to three rows (a batch-1 decode) run by whichever of the kernel, MKL and
  oneDNN was timed fastest for the shape, against MKL's always (the kernel's only form before 2026-11-28);
- `chunk-rows`: under serve.cpu_kernel, prompt chunks' tokens attending as rows of the C++ kernel (sequences up to
  fivefold.serve.kv_pool.KERNEL_CHUNK_CONTEXT tokens; `--chunk-context N`: up to N) against every chunk gathered
  for SDPA; `--output 1` times the prefill alone;
- `all`: the defaults against none of the lean loop, the input-major layout, huge pages and the C++ kernels.

Two engines on models built from the same seed, differing only in that choice, run alternately, so that
whatever the host does to one it does to the other: batch-1 decode tok/s, and output tok/s of a batch of
requests decoding together. On a host whose speed moves between processes (this project's 2-vCPU machine
reads memory at 39-46 GB/s in some and 68-74 in others), only a comparison inside one process says what a
change is worth.

    python bench/serve_cpu_ab.py --compare lean --json bench/results/serve_lean_ab.json     # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import statistics
import time

import torch
from machine import write_results
from serve_client import make_requests

from fivefold.model import build_model
from fivefold.model.attention import AttentionCore
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.kv_pool import PagedBatch
import fivefold.serve.kv_pool as kv_pool
import fivefold.serve.lean_forward as lean_forward
import fivefold.serve.cpu_linear as cpu_linear


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=sorted(SIDES), default="all", help="which choice to A/B")
    p.add_argument("--model", default="smollm2-135m", help="a preset (random weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's and the pool's")
    p.add_argument("--reps", type=int, default=6, help="alternating runs of each side")
    p.add_argument("--requests", type=int, default=16, help="requests decoding together in the batch run")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of each request of the batch run")
    p.add_argument("--output", type=int, default=48, help="output tokens of each request of the batch run")
    p.add_argument("--default-workload", action="store_true",
                   help="the batch run serves bench/serve.py's default request set instead (32 requests, prompt "
                        "and output 16-256, outputs log-uniform; --requests/--prompt/--output ignored)")
    p.add_argument("--chunk-context", type=int, default=0,
                   help="chunk-rows: the longest sequence whose chunks are kernel rows (default: the engine's)")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


# Per comparison, (name, options) of the side with the choice and of the side without: serve.* options,
# "input_major" (whether block weights may take the input-major layout), "rows_kernel" (whether the rows
# kernel is a candidate) and "rows_forms" (which of its forms are: "one-row" sets the form it had before its
# one to three rows were timed, MKL's product there).
SIDES = {
    "products": (("chosen per shape", {}), ("oneDNN", {"linear": "onednn"})),
    "layout": (("input-major", {}), ("plain", {"input_major": False})),
    "lean": (("lean loop", {}), ("modules", {"fuse_launches": False})),
    "huge-pages": (("huge pages", {"huge_pages": "true"}), ("4 KiB pages", {"huge_pages": "false"})),
    "heads-as-rows": (("heads as rows", {}), ("a row per head", {"heads_as_rows": False})),
    "lm-head": (("LM head as chosen", {}), ("LM head on F.linear", {"lm_head": "F.linear"})),
    "cpu-kernel": (("C++ paged decode kernel", {"cpu_kernel": "true"}), ("gather + SDPA", {"cpu_kernel": "false"})),
    "block-ops": (("C++ block ops", {}), ("torch's ops", {"block_ops": False})),
    "one-call": (("one call for all blocks", {}), ("a call per op", {"one_call": False})),
    "rows-kernel": (("rows kernel", {}), ("libraries' products", {"rows_kernel": False})),
    "one-row": (("one row as timed", {}), ("one row on MKL", {"rows_forms": ("rows kernel+F.linear",)})),
    "chunk-rows": (("prompt chunks as kernel rows", {}), ("prompt chunks gathered", {"chunk_rows": 0})),
    "all": (("defaults", {}), ("none of the five", {"input_major": False, "fuse_launches": False,
                                                    "huge_pages": "false", "cpu_kernel": "false"})),
}


@contextlib.contextmanager
def torch_block_ops():
    """The lean loop with torch's ops for its norms, RoPE and KV store where serve.cpu_kernel would make them
    C++ calls (PagedBatch.block_kernels off); the attention kernel as before."""
    init = PagedBatch.__init__

    def without(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.block_kernels = False
    PagedBatch.__init__ = without
    try:
        yield
    finally:
        PagedBatch.__init__ = init


@contextlib.contextmanager
def a_call_per_op():
    """The lean loop calling the C++ block ops one by one on decode-only steps too (no decode_blocks)."""
    find = lean_forward.one_call_blocks
    lean_forward.one_call_blocks = lambda blocks, rows: None
    try:
        yield
    finally:
        lean_forward.one_call_blocks = find


@contextlib.contextmanager
def chunk_rows_up_to(tokens: int):
    """Prompt chunks of sequences up to `tokens` long as the kernel's rows, longer ones gathered (0: all gathered)."""
    limit = kv_pool.KERNEL_CHUNK_CONTEXT
    kv_pool.KERNEL_CHUNK_CONTEXT = tokens
    try:
        yield
    finally:
        kv_pool.KERNEL_CHUNK_CONTEXT = limit


@contextlib.contextmanager
def one_row_per_head():
    """AttentionCore as it was before a decode's heads became query rows: every query head its own row."""
    forward = AttentionCore.forward
    AttentionCore.forward = lambda self, q, k, v, mask: self.attend(q, k, v, mask, self.groups)
    try:
        yield
    finally:
        AttentionCore.forward = forward


def make_llm(cfg, options: dict, dtype: torch.dtype = torch.float32) -> tuple[LLM, contextlib.AbstractContextManager]:
    """An engine with these serve.* options, and what to run it under; its block weights stay plain unless
    `input_major` (default), the rows kernel a candidate unless not `rows_kernel`, its LM head on the product
    `lm_head` names if given, and its attention with a row per head under the context if not `heads_as_rows`."""
    options = dict(options)
    chosen = cpu_linear.chosen_product
    listed = cpu_linear.candidates
    input_major, rows_kernel = options.pop("input_major", True), options.pop("rows_kernel", True)
    forms = options.pop("rows_forms", None)

    def choose(shape, dtype, mode="auto", layouts=True, rows=False):
        return chosen(shape, dtype, mode, layouts and input_major, rows and rows_kernel)

    def candidates(mode, layouts, rows=False):
        return [p for p in listed(mode, layouts, rows) if not p.library.startswith("rows ") or p.library in forms]
    cpu_linear.chosen_product = choose
    if forms is not None:
        cpu_linear.candidates = candidates
    head = options.pop("lm_head", None)
    context = contextlib.nullcontext if options.pop("heads_as_rows", True) else one_row_per_head
    if not options.pop("block_ops", True):
        context = torch_block_ops
    if not options.pop("one_call", True):
        context = a_call_per_op
    chunk_rows = options.pop("chunk_rows", None)
    if chunk_rows is not None:
        context = functools.partial(chunk_rows_up_to, chunk_rows)
    try:
        llm = LLM(build_model(cfg, "cpu", seed=0, dtype=dtype).eval(), device="cpu", seed=0, num_blocks=700,
                  max_num_seqs=64,
                  **options)
    finally:
        cpu_linear.chosen_product, cpu_linear.candidates = chosen, listed
    if head:
        llm.engine.model.lm_head.linear_fn = cpu_linear.LIBRARIES[head]
    return llm, context


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = get_preset(args.model)
    (with_name, with_options), (without_name, without_options) = SIDES[args.compare]
    if args.compare == "chunk-rows" and args.chunk_context:
        with_options = {**with_options, "chunk_rows": args.chunk_context}
    dtype = getattr(torch, args.dtype)
    made = {with_name: make_llm(cfg, with_options, dtype), without_name: make_llm(cfg, without_options, dtype)}
    llms = {name: llm for name, (llm, _) in made.items()}
    for name, llm in llms.items():
        head = getattr(llm.engine.model.lm_head, "linear_fn", None)
        print(f"{name}: {llm.engine.path}; LM head on {getattr(head, '__name__', head)}")
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = list(range(100, 228))
    rng = random.Random(0)
    batch1 = {name: [] for name in llms}
    batch = {name: [] for name in llms}
    tokens = {name: [] for name in llms}  # every run's batch outputs, to say whether the two sides agree
    for _ in range(args.reps):
        if args.default_workload:  # bench/serve.py's own set, the same every rep
            requests = make_requests(32, cfg.vocab_size, (16, 256), (16, 256), seed=0)
            prompts = [r.prompt for r in requests]
            params = [SamplingParams(max_tokens=r.max_tokens, **greedy) for r in requests]
        else:
            prompts = [[rng.randrange(1, cfg.vocab_size) for _ in range(args.prompt)] for _ in range(args.requests)]
            params = [SamplingParams(max_tokens=args.output, **greedy)] * len(prompts)
        for name, (llm, context) in made.items():
            with context():
                out = llm.generate([prompt], SamplingParams(max_tokens=64, **greedy))[0]
                batch1[name].append(1 / out.tpot)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                batch[name].append(sum(p.max_tokens for p in params) / (time.perf_counter() - start))
                tokens[name] += [out.token_ids for out in outs]
    result = {"compare": args.compare, "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "reps": args.reps,
              "requests": args.requests, "prompt": args.prompt, "output": args.output, "paths": {n: llm.engine.path for n, llm in llms.items()},
              "same_tokens": f"{sum(a == b for a, b in zip(*tokens.values()))} of {len(tokens[with_name])} requests"}
    print(f"token-identical: {result['same_tokens']}")
    batch_label = "default_workload_output_tok_s" if args.default_workload else f"batch{args.requests}_output_tok_s"
    result["default_workload"] = args.default_workload
    for label, runs in (("batch1_decode_tok_s", batch1), (batch_label, batch)):
        summary = {n: {"runs": xs, "best": max(xs), "median": statistics.median(xs)} for n, xs in runs.items()}
        summary["gain_best"] = summary[with_name]["best"] / summary[without_name]["best"] - 1
        summary["gain_median"] = summary[with_name]["median"] / summary[without_name]["median"] - 1
        result[label] = summary
        print(f"{label}: {without_name} best {summary[without_name]['best']:.1f} median "
              f"{summary[without_name]['median']:.1f}; {with_name} best {summary[with_name]['best']:.1f} median "
              f"{summary[with_name]['median']:.1f}; gain {100 * summary['gain_best']:+.1f}% (best) "
              f"{100 * summary['gain_median']:+.1f}% (median)")
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
