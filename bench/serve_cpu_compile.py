"""Whether torch.compile pays for the CPU engine's decode step on this machine (issue 30's CPU batch-1 target:
>= 60% of the measured read bandwidth). The engine runs its CPU steps eagerly; this bench measures what
compiling the step's loop over the blocks would give, and re-checks it on a new torch or a new host.

One process, one model: batch-1 decodes run in turns through the engine's lean loop
(fivefold/serve/lean_forward.py) eager and through the same loop compiled by inductor. The paged attention
(store, gather, SDPA) stays one registered op whose schema says it writes the KV pool, so compiling neither
copies the pool nor breaks the graph; everything else of the 30 blocks (norms, RoPE, the SwiGLU, the residual
adds, the products) is one graph. Also timed: the compile (the first compiled decode's wall time beyond
the eager one's; inductor's on-disk cache shortens a second run's), and the fixed cost of calling a compiled function against the eager ops it fuses (RMSNorm, SiLU and a
multiply at one row), which is what a decode step is made of.

    python bench/serve_cpu_compile.py --json bench/results/serve_cpu_compile.json   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from machine import base_info, write_results

import fivefold.serve.lean_forward as lean
from fivefold.model import build_model
from fivefold.model.rope import rope_cos_sin
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams

# The step being run, for the attention op: a registered op takes tensors and numbers, not the step's
# grouping, which the eager attention reads from its PagedBatch.
_STEP: dict = {}
_LIB = torch.library.Library("fivefold_bench", "DEF")
_LIB.define("paged_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, int layer) -> Tensor")


def _paged_attend(q, k, v, k_pool, v_pool, layer):
    return _STEP["batch"].attend_heads(layer, q, k, v, _STEP["cores"][layer])


_LIB.impl("paged_attend", _paged_attend, "CPU")
torch.library.register_fake("fivefold_bench::paged_attend", lambda q, k, v, kp, vp, layer: torch.empty_like(q),
                            lib=_LIB)


def blocks_loop(blocks, x, cos, signed_sin, k_pools, v_pools, half: int):
    """LeanTransformer.forward's loop over the blocks, the attention as the registered op."""
    t = x.shape[0]
    for layer, (attn_norm, attn, o_proj, mlp_norm, mlp, down_proj) in enumerate(blocks):
        d = attn.head_dim
        heads = attn.qkv(lean.rms_norm(attn_norm, x)).view(t, -1, d)
        nq, nk = attn.qkv_sizes[0] // d, attn.qkv_sizes[1] // d
        qk = heads[:, :nq + nk]
        qk = qk * cos + qk.roll(half, -1) * signed_sin
        out = torch.ops.fivefold_bench.paged_attend(qk[:, :nq], qk[:, nq:], heads[:, nq + nk:], k_pools[layer],
                                                    v_pools[layer], layer)
        x = x + o_proj.forward(out.reshape(t, -1))
        gate, up = mlp.gate_up(lean.rms_norm(mlp_norm, x)).chunk(2, dim=-1)
        x = x + down_proj.forward(F.silu(gate) * up)
    return x


class CompiledLean(lean.LeanTransformer):
    """The lean forward with its blocks' loop compiled, on decode-only steps of one group (every batch-1
    decode); the engine's own forward otherwise (prefill)."""
    loop = None

    def forward(self, input_ids, ctx=None):
        batch = None if ctx is None else ctx.kv_cache
        blocks = lean.lean_blocks(self) if getattr(batch, "lean", False) else None
        if blocks is None or not batch.whole:
            return super().forward(input_ids, ctx)
        positions = self.positions(input_ids, ctx)
        x = self.embed(input_ids, positions)[0]
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        half = cos.shape[-1] // 2
        cos, sin = cos[0, 0, :, None], sin[0, 0, :, None]
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        _STEP.update(batch=batch, cores=[b[1].core.forward for b in blocks])
        pool = batch.pool
        x = self.loop(blocks, x, cos, signed_sin, list(pool.k), list(pool.v), half)
        if ctx.logits_at is not None:
            x = x[ctx.logits_at]
        return self.lm_head.forward(lean.rms_norm(self.norm, x))


def call_overhead(reps: int = 5000) -> dict:
    """Microseconds per call at one row of 576: three eager elementwise ops, and the same compiled."""
    def fused(x, w):
        return F.silu(F.rms_norm(x, w.shape, w, 1e-5)) * x

    x, w = torch.randn(1, 576), torch.randn(576)
    compiled = torch.compile(fused, dynamic=False)
    out = {}
    with torch.inference_mode():
        for name, fn in (("eager, 3 ops", fused), ("compiled", compiled)):
            for _ in range(300):
                fn(x, w)
            start = time.perf_counter()
            for _ in range(reps):
                fn(x, w)
            out[name] = (time.perf_counter() - start) / reps * 1e6
    return out


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
    llm = LLM(model, device="cpu", seed=0, num_blocks=-(-(args.prompt + args.output) // 16) + 1)
    if type(llm.engine.model) is not lean.LeanTransformer:
        raise SystemExit(f"the engine does not run the lean loop here ({llm.engine.path}); nothing to compare")
    prompt = list(range(5, 5 + args.prompt))
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)

    def decode(compiled: bool):
        model.__class__ = CompiledLean if compiled else lean.LeanTransformer
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        return out, time.perf_counter() - start

    eager_ref, eager_first = decode(False)
    CompiledLean.loop = staticmethod(torch.compile(blocks_loop, dynamic=None))
    compiled_ref, compiled_first = decode(True)  # compiles once, then again with the context length dynamic
    tok_s: dict = {"eager": [], "compiled": []}
    for _ in range(args.reps):
        for side in ("eager", "compiled"):
            out, _ = decode(side == "compiled")
            tok_s[side].append(1 / out.tpot)
    model.__class__ = lean.LeanTransformer
    result = {"machine": {**base_info(), "threads": torch.get_num_threads()}, "model": args.model,
              "engine_path": llm.engine.path, "prompt": args.prompt, "output": args.output,
              "tokens_per_s": tok_s,
              "best": {k: max(v) for k, v in tok_s.items()}, "median": {k: statistics.median(v) for k, v in tok_s.items()},
              "compile_s": compiled_first - eager_first,
              "same_tokens": compiled_ref.token_ids == eager_ref.token_ids,
              "call_overhead_us": call_overhead()}
    result["compiled_over_eager"] = {k: result[k]["compiled"] / result[k]["eager"] for k in ("best", "median")}
    print(f"{args.model}, batch-1 decode of {args.output} tokens after {args.prompt}, {llm.engine.path}")
    for side in ("eager", "compiled"):
        print(f"  {side:<9} best {result['best'][side]:.1f} tok/s, median {result['median'][side]:.1f} "
              f"({', '.join(f'{v:.1f}' for v in tok_s[side])})")
    r = result["compiled_over_eager"]
    print(f"  compiled / eager: best {r['best']:.2f}x, median {r['median']:.2f}x; the compile took "
          f"{result['compile_s']:.0f} s; same tokens: {result['same_tokens']}")
    print("  per call, us: " + ", ".join(f"{k} {v:.1f}" for k, v in result["call_overhead_us"].items()))
    if args.json:
        write_results(args.json, result)
    return result


if __name__ == "__main__":
    main()
