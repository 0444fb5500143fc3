"""Whether compiling the CPU engine's decode step pays on this machine (serve.compile_decode; issue 30's CPU
batch-1 target: >= 60% of the measured read bandwidth), and re-checks it on a new torch or a new host.

One process, one model, one engine built with serve.compile_decode=true, serve.cpu_kernel=false (the graph
runs only the decode steps the C++ block ops cannot) and serve.linear=torch (oneDNN's products do not
compile): batch-1 decodes run in turns through the eager lean loop (fivefold/serve/lean_forward.py) and
through the same loop compiled by inductor
(fivefold/serve/compiled_decode.py: one graph over all the blocks, the paged attention a registered op that
writes the KV pool). Also timed: the compile (the first compiled decode's wall time beyond the eager one's;
inductor's on-disk cache shortens a second run's), and the fixed cost of calling a compiled function against
the eager ops it fuses (RMSNorm, SiLU and a multiply at one row), which is what a decode step is made of.
Beside them, in turns, the default engine on the same weights, whose decode steps are one C++ call
(fivefold.kernels.cpu_block_ops.decode_blocks).

    python bench/serve_cpu_compile.py --json bench/results/serve_cpu_compile.json   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from machine import base_info, us_per_call, write_results

from fivefold.model import build_model
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.compiled_decode import CompiledDecodeTransformer
from fivefold.serve.lean_forward import LeanTransformer


def call_overhead(reps: int = 5000) -> dict:
    """Microseconds per call at one row of 576: three eager elementwise ops, and the same compiled."""
    def fused(x, w):
        return F.silu(F.rms_norm(x, w.shape, w, 1e-5)) * x

    x, w = torch.randn(1, 576), torch.randn(576)
    return us_per_call({"eager, 3 ops": fused, "compiled": torch.compile(fused, dynamic=False)}, x, w, reps=reps,
                       warmup=300)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a preset (random weights, fp32)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--reps", type=int, default=5, help="decodes of each side, in turns")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    cfg = get_preset(args.model)
    model = build_model(cfg, "cpu", seed=0, dtype=torch.float32).eval()
    blocks = -(-(args.prompt + args.output) // 16) + 1
    # The graph runs the decode steps the C++ block ops cannot (fivefold.serve.compiled_decode): timed against
    # the torch loop it compiles with those ops off and F.linear's products (oneDNN's op does not compile), and
    # beside the default engine's C++ call on the same weights.
    llm = LLM(model, device="cpu", seed=0, num_blocks=blocks, compile_decode=True, cpu_kernel="false",
              linear="torch")
    default = LLM(build_model(cfg, "cpu", seed=0, dtype=torch.float32).eval(), device="cpu", seed=0,
                  num_blocks=blocks)
    prompt = list(range(5, 5 + args.prompt))
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)

    def decode(side: str):
        model.__class__ = CompiledDecodeTransformer if side == "compiled" else LeanTransformer
        start = time.perf_counter()
        out = (default if side == "C++ call" else llm).generate([prompt], params)[0]
        return out, time.perf_counter() - start

    eager_ref, eager_first = decode("eager")
    compiled_ref, compiled_first = decode("compiled")  # compiles once, then again with the context length dynamic
    decode("C++ call")
    tok_s: dict = {"eager": [], "compiled": [], "C++ call": []}
    for _ in range(args.reps):
        for side in tok_s:
            out, _ = decode(side)
            tok_s[side].append(1 / out.tpot)
    model.__class__ = CompiledDecodeTransformer
    result = {"machine": {**base_info(), "threads": torch.get_num_threads()}, "model": args.model,
              "engine_path": llm.engine.path, "prompt": args.prompt, "output": args.output,
              "tokens_per_s": tok_s,
              "best": {k: max(v) for k, v in tok_s.items()}, "median": {k: statistics.median(v) for k, v in tok_s.items()},
              "compile_s": compiled_first - eager_first,
              "same_tokens": compiled_ref.token_ids == eager_ref.token_ids, "compiled_steps": model.compiled_steps,
              "call_overhead_us": call_overhead()}
    result["default_engine_path"] = default.engine.path
    result["compiled_over_eager"] = {k: result[k]["compiled"] / result[k]["eager"] for k in ("best", "median")}
    result["cpp_call_over_compiled"] = {k: result[k]["C++ call"] / result[k]["compiled"] for k in ("best", "median")}
    print(f"{args.model}, batch-1 decode of {args.output} tokens after {args.prompt}, {llm.engine.path}")
    print(f"C++ call: the default engine, {default.engine.path}")
    for side in tok_s:
        print(f"  {side:<9} best {result['best'][side]:.1f} tok/s, median {result['median'][side]:.1f} "
              f"({', '.join(f'{v:.1f}' for v in tok_s[side])})")
    r = result["compiled_over_eager"]
    print(f"  compiled / eager: best {r['best']:.2f}x, median {r['median']:.2f}x; the compile took "
          f"{result['compile_s']:.0f} s; same tokens: {result['same_tokens']}")
    r = result["cpp_call_over_compiled"]
    print(f"  C++ call / compiled: best {r['best']:.2f}x, median {r['median']:.2f}x")
    print("  per call, us: " + ", ".join(f"{k} {v:.1f}" for k, v in result["call_overhead_us"].items()))
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
