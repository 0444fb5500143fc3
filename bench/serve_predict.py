"""The serving simulator against the engine it predicts, on this machine: output tok/s and p50 TTFT / TPOT.

For each workload, the engine serves it (greedy to each request's output length, all requests at t=0, as
bench/serve.py does) and `fivefold plan --serve`'s simulator predicts it from a calibrated profile of this
machine (`fivefold calibrate --serve`); the errors are printed side by side.

    python bench/serve_predict.py --profile cpu.toml --json bench/results/serve_predict_cpu.json
    python bench/serve_predict.py                     # calibrates this machine first (~1 min)
    python bench/serve_predict.py --device cuda --model llama3.2-1b   # on a GPU (bf16, its own calibration)

Workloads: default (bench/serve.py's own request set: 32 requests, prompt and output 16-256 log-uniform),
chat (short prompts, medium answers), summarise (long prompts, short answers); --workloads takes names or
specs (fivefold.serve.workload), separated by ';'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

from fivefold.commands.plan_serve import predict
from fivefold.config import Config, ServeConfig
from fivefold.model import build_model
from fivefold.parallel.mesh import synchronize
from fivefold.planner.hardware import load_profile
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.blocks import blocks_for
from fivefold.serve.workload import Request, Workload, parse_workload

sys.path.insert(0, os.path.dirname(__file__))
from machine import write_results  # noqa: E402
from serve_client import make_requests  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="", help="a profile from `fivefold calibrate --serve`; default: calibrate now")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default="default;chat;summarise",
                   help="';'-separated names or specs (a spec's own fields are ','-separated)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=2,
                   help="engine runs per workload; the fastest is kept (outside load only slows a run down)")
    p.add_argument("--cpu-kernel", default="auto", choices=["auto", "true", "false"],
                   help="serve.cpu_kernel for the engine, the model and the calibration's decode steps")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def workload(name: str, vocab: int) -> Workload:
    if name == "default":  # bench/serve.py's request set, to the token
        reqs = make_requests(32, vocab, (16, 256), (16, 256), 0)
        return Workload([Request(0.0, len(r.prompt), r.max_tokens) for r in reqs], "default (bench/serve.py)")
    return parse_workload(name)


def serve_config(args, w: Workload) -> ServeConfig:
    # As bench/serve.py: room for every request at once plus a spare block each (no preemption).
    blocks = sum(blocks_for(r.prompt + r.output, 16) for r in w.requests) + len(w.requests)
    longest = max(r.prompt + r.output for r in w.requests)
    return dataclasses.replace(ServeConfig(), num_blocks=blocks, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                               max_model_len=blocks_for(longest, 16) * 16, cpu_kernel=args.cpu_kernel)


def measure(model, serve: ServeConfig, w: Workload, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (r.prompt,), generator=g).tolist() for r in w.requests]
    params = [SamplingParams(max_tokens=r.output, temperature=0, ignore_eos=True) for r in w.requests]
    llm = LLM(model, device=device, **{f.name: getattr(serve, f.name) for f in dataclasses.fields(serve)})
    # Warm up on prompts of its own (the workload's would sit in the prefix cache and shorten its prefill), one
    # a full step's token budget long: the first step of that size pays the allocator's first-touch of its
    # activations, a start-up cost the model does not price.
    budget = min(serve.max_num_batched_tokens, serve.max_model_len or serve.max_num_batched_tokens) - 8
    warm = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (32, budget)]
    llm.generate(warm, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2)
    assert llm.engine.blocks.hit_tokens == 0
    synchronize(torch.device(device))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start  # the engine waited for the device at each step's tokens
    tokens = sum(len(o.token_ids) for o in outs)
    assert sum(o.num_cached_tokens for o in outs) == 0, "a prompt hit the prefix cache: the simulator assumes none"
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall, "steps": llm.engine.stats["steps"],
            "ttft_p50_s": statistics.median(o.ttft for o in outs),
            "tpot_p50_s": statistics.median(o.tpot for o in outs if o.tpot is not None)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        from fivefold.planner.calibrate import calibrate
        from fivefold.serve.step_cost import SHORT_DTYPES, measure_serving

        print("calibrating this machine (fivefold calibrate --serve) ...", flush=True)
        device = torch.device(args.device)
        profile, _ = calibrate(device, f"this-{args.device}")
        profile = dataclasses.replace(profile, serving=measure_serving(device, profile, SHORT_DTYPES[args.dtype],
                                                                           args.cpu_kernel))
    print(f"profile {profile.name}: fp32 {profile.flops['fp32'] / 1e9:.0f} GFLOP/s, {profile.memory_bandwidth / 1e9:.1f} "
          f"GB/s, serving {profile.serving}")
    cfg_model = get_preset(args.model)
    model = build_model(cfg_model, args.device, seed=0, dtype=getattr(torch, args.dtype)).eval()
    rows = []
    for name in filter(None, (x.strip() for x in args.workloads.split(";"))):
        w = workload(name, cfg_model.vocab_size)
        serve = serve_config(args, w)
        cfg = Config(model=cfg_model, serve=serve)
        predicted = predict(cfg, profile, w, num_blocks=serve.num_blocks).summary()
        print(f"{name}: {len(w.requests)} requests, {w.prompt_tokens} prompt + {w.output_tokens} output tokens; "
              f"engine ...", flush=True)
        runs = [measure(model, serve, w, args.device) for _ in range(args.reps)]
        measured = max(runs, key=lambda r: r["output_tokens_per_s"])
        measured["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
        error = {k: predicted[k] / measured[k] - 1 for k in ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s")}
        rows.append({"workload": name, "measured": measured, "predicted": predicted, "error": error})
    print(f"\n{'workload':<12} | {'out tok/s':>19} {'err':>6} | {'TTFT p50 ms':>19} {'err':>6} | "
          f"{'TPOT p50 ms':>17} {'err':>6}")
    print(f"{'':<12} | {'engine':>9} {'model':>9} {'':>6} | {'engine':>9} {'model':>9} {'':>6} | {'engine':>8} "
          f"{'model':>8}")
    for r in rows:
        m, p, e = r["measured"], r["predicted"], r["error"]
        print(f"{r['workload']:<12} | {m['output_tokens_per_s']:>9.1f} {p['output_tokens_per_s']:>9.1f} "
              f"{100 * e['output_tokens_per_s']:>+5.1f}% | {1e3 * m['ttft_p50_s']:>9.0f} {1e3 * p['ttft_p50_s']:>9.0f} "
              f"{100 * e['ttft_p50_s']:>+5.1f}% | {1e3 * m['tpot_p50_s']:>8.1f} {1e3 * p['tpot_p50_s']:>8.1f} "
              f"{100 * e['tpot_p50_s']:>+5.1f}%")
    worst = max(abs(v) for r in rows for v in r["error"].values())
    print(f"worst error {100 * worst:.1f}% (target: within 15%)")
    out = {"profile": dataclasses.asdict(profile), "model": args.model, "device": args.device, "dtype": args.dtype,
           "rows": rows, "worst_error": worst, "threads": torch.get_num_threads(),
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None}
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
