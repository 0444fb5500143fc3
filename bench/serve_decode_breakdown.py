"""Where a batch-1 decode token's time goes in the serving engine on this CPU: the linear products (the LM
head apart), each kind of other work in the forward, and the engine's work outside the forward; plus the
per-call overhead of the product kernels themselves. The figures behind issue 30's CPU batch-1 target
(>= 60% of the measured read bandwidth), which needs the whole token within the products' streaming time
and a few milliseconds.

    python bench/serve_decode_breakdown.py [--model smollm2-135m] [--json FILE]

Each piece is timed by wrapping it (perf_counter around the call; a CPU runs synchronously), over one whole
generation after a warm-up one. The wrappers add ~0.3 us a call, a few percent of the smallest pieces.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from machine import base_info, us_per_call, write_results

import fivefold.serve.cpu_linear as cpu_linear
from fivefold.model import build_model
from fivefold.planner.calibrate import measure_bandwidth
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.kv_pool import PagedBatch


def timed(times: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name] += time.perf_counter() - start
        return out
    return wrapper


def instrument(llm: LLM, times: dict) -> None:
    """Wrap the products (every oneDNN / F.linear call the model makes, the LM head apart), the paged
    attention and its core, the forward and the engine step; on the modules' path (`--modules`) also the
    norms, RoPE and each layer, which the lean loop (fivefold.serve.lean_forward) runs inline."""
    model, engine = llm.engine.model, llm.engine
    for module in model.modules():
        if module is model.lm_head:
            continue
        if hasattr(module, "linear_fn"):  # the product chosen for its shape (fivefold.serve.cpu_linear)
            module.linear_fn = timed(times, "products", module.linear_fn)
        elif isinstance(module, torch.nn.Linear):
            module.forward = (lambda m: timed(times, "products", m.forward))(module)
    model.lm_head.forward = timed(times, "lm_head", model.lm_head.forward)
    for layer in model.layers:
        layer.attn.core.forward = timed(times, "attention core (SDPA)", layer.attn.core.forward)
        if not engine.lean:
            for norm in (layer.attn_norm, layer.mlp_norm):
                norm.forward = timed(times, "norms", norm.forward)
            layer.attn.rope_fn = timed(times, "rope", layer.attn.rope_fn)
            layer.forward = timed(times, "layers", layer.forward)
    # Wrapping the products sends decode steps through the loop's calls one by one: C++ cannot call a wrapper
    # (fivefold.kernels.cpu_block_ops.decode_blocks), so this times that loop.
    PagedBatch.attend_heads = timed(times, "attention (store, gather, core)", PagedBatch.attend_heads)
    # serve.cpu_kernel's decode-only steps: RoPE, the store and the attention in one C++ call
    PagedBatch.attend_rotary_rows = timed(times, "attention (store, gather, core)", PagedBatch.attend_rotary_rows)
    engine._forward = timed(times, "forward", engine._forward)
    engine.step = timed(times, "step", engine.step)


def call_overhead(reps: int = 4000) -> dict:
    """Microseconds per call of each product kernel on a 64 x 64 weight, one row: its fixed cost."""
    x, w = torch.randn(1, 64), torch.randn(64, 64)
    return us_per_call({"onednn": cpu_linear.onednn_linear, "F.linear": F.linear}, x, w, reps=reps)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--output", type=int, default=128, help="generated tokens")
    p.add_argument("--modules", action="store_true",
                   help="run the model's modules step by step (serve.fuse_launches=false), timing norms and RoPE too")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    cfg = get_preset(args.model)
    model = build_model(cfg, "cpu", seed=0, dtype=torch.float32).eval()
    llm = LLM(model, device="cpu", seed=0, num_blocks=-(-(args.prompt + args.output) // 16) + 1,
              fuse_launches=not args.modules)
    prompt = list(range(5, 5 + args.prompt))
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    # Uninstrumented first: with the products wrapped, the engine's decode steps can no longer be one C++ call
    # for every block (fivefold.kernels.cpu_block_ops.decode_blocks), so the pieces below time the loop calling
    # the same ops one by one.
    plain = 1 / llm.generate([prompt], params)[0].tpot
    times: dict = collections.defaultdict(float)
    instrument(llm, times)
    out = llm.generate([prompt], params)[0]
    n = args.output
    ms = {k: 1e3 * v / n for k, v in times.items()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    bandwidth = measure_bandwidth()["read_gb_per_s"]
    other = ms["forward"] - ms["products"] - ms["lm_head"]
    result = {"machine": {**base_info(), "threads": torch.get_num_threads()}, "model": args.model,
              "path": llm.engine.path, "tokens_per_s": 1 / out.tpot, "uninstrumented_tokens_per_s": plain,
              "ms_per_token": ms,
              "forward_other_ms": other, "outside_forward_ms": ms["step"] - ms["forward"],
              "block_products_gb_per_s": (weights - head) / 1e6 / ms["products"],
              "lm_head_gb_per_s": head / 1e6 / ms["lm_head"], "read_gb_per_s": bandwidth,
              "fraction_of_read_bandwidth": weights / 1e9 / out.tpot / bandwidth,
              "call_overhead_us": call_overhead()}
    print(f"{args.model}, batch-1 decode, {llm.engine.path}")
    print(f"uninstrumented: {plain:.1f} tok/s = {100 * weights / 1e9 * plain / bandwidth:.0f}% of the read below")
    print(f"instrumented: {result['tokens_per_s']:.1f} tok/s = {100 * result['fraction_of_read_bandwidth']:.0f}% of a "
          f"{bandwidth:.1f} GB/s read; per token, ms:")
    print(f"  block products {ms['products']:.2f} ({result['block_products_gb_per_s']:.1f} GB/s), LM head "
          f"{ms['lm_head']:.2f} ({result['lm_head_gb_per_s']:.1f} GB/s)")
    pieces = f"norms {ms['norms']:.2f}, RoPE {ms['rope']:.2f}, " if args.modules else ""
    print(f"  the rest of the forward {other:.2f}: {pieces}attention "
          f"{ms['attention (store, gather, core)']:.2f} (of which SDPA {ms['attention core (SDPA)']:.2f})")
    print(f"  engine work outside the forward {result['outside_forward_ms']:.2f}")
    print("  per product call, us: " + ", ".join(f"{k} {v:.1f}" for k, v in result["call_overhead_us"].items()))
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
