"""`fivefold plan` (predicted memory per rank, instant) and `fivefold memory` (measured, real steps)."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import torch

from fivefold.commands import plan_fit, plan_serve, plan_speed
from fivefold.commands.args import add_config_args, config_from_args, nonnegative_int, positive_int
from fivefold.commands.plan_fit import run_fit
from fivefold.config import ConfigError
from fivefold.parallel.rules import check_layout
from fivefold.memory.plan import model_name, plan_memory, scores_materialised
from fivefold.memory.plots import plot_recompute_sweep, plot_sweep, plot_timeline
from fivefold.memory.sweeps import RECOMPUTE_SWEEP_NOTE, recompute_sweep, sweep, sweep_replays_eager
from fivefold.memory.tracker import measure_memory, random_datasets
from fivefold.memory.units import human_bytes, parse_bytes
from fivefold.parallel.launch import launch_workers
from fivefold.planner.hardware import load_profile
from fivefold.serve.kv_pool import available_memory
from fivefold.serve.plan import QuantizedLinears, plan_serving
from fivefold.weights import weight_source


def register(sub) -> None:
    plan = sub.add_parser("plan", help="predict memory per rank (parameters, gradients, optimizer states, "
                                       "activations) from a config, without building the model")
    add_config_args(plan)
    plan.add_argument("--device-memory", help="memory of one accelerator, e.g. 80GB (1e9 bytes) or 80GiB")
    plan.add_argument("--cluster", metavar="PROFILE",
                      help="a hardware profile (h100-sxm, h100-hbm2e-500w, h200, a100-80gb, a100-40gb, or a file "
                           "from `fivefold calibrate`): its device memory and device kind; see `fivefold hardware`")
    plan.add_argument("--device", choices=("cuda", "cpu"), default=None,
                      help="which kernels to assume (SDPA backend, LayerNorm statistics dtype); default cuda")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--sweep", choices=("seq", "batch", "recompute"),
                      help="activation memory over train.seq_len or train.micro_batch_size, eager vs SDPA; or "
                           "against recomputation (none, every k-th layer, full, selective) with its extra compute")
    plan.add_argument("--values", help="comma-separated sweep values (default: powers of two around the config's; "
                                       "for recompute, the k of every:k)")
    plan.add_argument("--png", help="with --sweep or --search: write the plot here")
    plan.add_argument("--serve", action="store_true",
                      help="serving instead of training: weights, the KV pool (serve.*), and how many "
                           "sequences of each length fit at once; with --cluster, also the throughput and "
                           "latency of --workload (fivefold.serve.simulator)")
    plan.add_argument("--model", metavar="PATH",
                      help="with --serve: the model at PATH (a run, checkpoint, Hugging Face or quantized directory, "
                           "as `fivefold serve` takes it), read without its weights: its shape, and a quantized "
                           "directory's stored bytes and dequantizing")
    plan.add_argument("--workload", metavar="SPEC",
                      help="with --serve --cluster: the traffic, e.g. requests=256,prompt=100:1024,output=100:1024,"
                           "dist=uniform,rate=4 (rate 0: all at t=0), a name (default, chat, summarise, anchors) "
                           "or a JSONL trace of {arrival, prompt, output}; default: default")
    plan.add_argument("--max-tpot", type=float, default=0.05, metavar="SECONDS",
                      help="with --serve --search: the p99 time-per-output-token bound layouts must meet (0.05)")
    plan_speed.add_arguments(plan)
    plan_fit.add_arguments(plan)
    plan.set_defaults(func=run_plan)

    mem = sub.add_parser("memory", help="measure memory by category over the first training steps, plot "
                                        "the timeline, and compare with the plan")
    add_config_args(mem)
    mem.add_argument("--steps", type=positive_int, default=4, help="training steps to run (default 4)")
    mem.add_argument("--png", help="write the stacked-area timeline here")
    mem.add_argument("--json", action="store_true", help="print one JSON object (peaks, comparison, samples)")
    mem.add_argument("--rank", type=nonnegative_int, default=0,
                     help="with --nproc: the rank that reports (default 0), e.g. the last pipeline stage's")
    mem.add_argument("--synthetic", action="store_true",
                     help="random tokens instead of the configured dataset (memory does not depend on them)")
    mem.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                     help="measure under torchrun with N processes (e.g. parallel.dp=N with parallel.zero=3); "
                          "rank 0 reports its own memory")
    mem.add_argument("--cuda-history", metavar="FILE",
                     help="on CUDA, also dump torch.cuda.memory's allocation history (pytorch.org/memory_viz)")
    mem.set_defaults(func=run_memory)


def run_plan(args) -> int:
    cfg = config_from_args(args)
    quantized = None
    if args.model:
        if not args.serve:
            raise ConfigError("--model plans serving the model at a path: add --serve (a training plan takes "
                              "the model from --preset / --config / --set model.*)")
        given = ["--preset"] * bool(args.preset) + [o.split("=")[0] for o in args.overrides if o.startswith("model.")]
        if given:
            raise ConfigError(f"--model takes the model's shape from {args.model}: drop {', '.join(given)}")
        source = weight_source(args.model)
        cfg.model = source.config.model
        check_layout(cfg, implemented=False)  # the model's heads against parallel.tp, as load_config checks
        quantized = QuantizedLinears.read(source.directory) if source.kind == "quantized" else None
        if quantized and cfg.parallel.tp > 1:
            raise ConfigError(f"{args.model} is a quantized model: it is served with tp=1 (its codes are not "
                              f"sharded); drop parallel.tp")
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    profile = None
    if args.cluster:
        profile = load_profile(args.cluster)
        device_memory = device_memory or int(profile.memory_bytes)
        args.device = args.device or profile.device
    elif not args.fit and ((args.search and not args.serve) or args.gpus or args.global_batch):
        raise ConfigError("--search, --gpus and --global-batch predict speed: give the hardware with --cluster "
                          "PROFILE (see `fivefold hardware`)")
    args.device = args.device or "cuda"
    if args.fit and device_memory is None and profile is None and args.device == "cpu":
        device_memory = _this_host()
    if args.fit:
        return run_fit(args, cfg, device_memory, profile)
    if args.headroom is not None or args.grow_batch:
        raise ConfigError("--headroom and --grow-batch choose how --fit fills memory: add --fit")
    if profile is not None and not args.serve and not args.sweep:
        if args.search:
            return plan_speed.run_search(args, cfg, profile, device_memory)
        if args.gpus or args.global_batch:
            batch = plan_speed.parse_tokens(args.global_batch) if args.global_batch else None
            cfg = plan_speed.placed(cfg, args.gpus, batch)
        plan = plan_memory(cfg, device_memory, device=args.device)
        plan_speed.run_speed(args, cfg, plan, profile)
        return 0
    if args.serve:
        if profile is None and (args.workload or args.search):
            raise ConfigError("--workload and --search with --serve predict speed: give the hardware with "
                              "--cluster PROFILE (a shipped one, or `fivefold calibrate --serve --out FILE`)")
        if cfg.serve.kv_memory < 1 and not cfg.serve.num_blocks and device_memory is None:
            if args.device != "cpu" or profile is not None:
                raise ConfigError(f"serve.kv_memory={cfg.serve.kv_memory} is a fraction of free memory: pass "
                                  f"--device-memory (or --device cpu for this host's), or give serve.kv_memory in "
                                  f"GB (>= 1) or serve.num_blocks")
            device_memory = _this_host()
        if profile is not None:
            if quantized:
                raise ConfigError("--model with a quantized directory plans memory only: leave out --cluster (the "
                                  "speed model prices full-precision linears)")
            return plan_serve.run(args, cfg, profile, device_memory)
        serving = plan_serving(cfg, device_memory, device=args.device, quantized=quantized)
        print(json.dumps(serving.to_json(), indent=2) if args.json else serving.table())
        return 0
    if args.sweep:
        return _run_sweep(args, cfg, sweep)
    plan = plan_memory(cfg, device_memory, device=args.device)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return 0


def _this_host() -> int:
    """This host's memory as a process started now would find it (fivefold.serve.kv_pool.available_memory:
    the RAM the kernel can give), announced on stderr (stdout may be JSON)."""
    memory = available_memory(torch.device("cpu"))
    print(f"planning for this host: {human_bytes(memory)} available now (--device-memory plans for another)",
          file=sys.stderr)
    return memory


def _sweep_values(cfg, key: str) -> list[int]:
    if key == "seq":
        cap = cfg.model.max_seq_len if cfg.model.position == "learned" else 1 << 20
        values = [int(cfg.train.seq_len * 2.0 ** i) for i in range(-4, 3)]
        values = [v for v in values if 16 <= v <= cap]
        return values if len(values) >= 2 else [v for v in (64, 128, 256, 512) if v <= cap]
    return [2 ** i for i in range(0, max(5, int(math.log2(cfg.train.micro_batch_size)) + 2))]


def _run_recompute_sweep(args, cfg) -> int:
    every = [int(v) for v in args.values.split(",")] if args.values else None
    rows = recompute_sweep(cfg, device=args.device, every=every)
    note = RECOMPUTE_SWEEP_NOTE if sweep_replays_eager(cfg, args.device) else ""
    if args.json:
        print(json.dumps({"key": "recompute", "rows": rows, **({"note": note} if note else {})}, indent=2))
    else:
        print(f"{'recompute':>12s} {'layers':>7s} {'activations':>12s} {'total':>12s} {'extra compute':>14s}")
        for r in rows:
            print(f"{r['recompute']:>12s} {r['recomputed_layers']:>7d} {human_bytes(r['activations']):>12s} "
                  f"{human_bytes(r['total']):>12s} {100 * r['extra_compute']:>13.1f}%")
        if note:
            print(f"note: {note}")
    if args.png:
        title = (f"{model_name(cfg)}: activation memory per rank vs recomputation\n{cfg.train.precision}, "
                 f"seq {cfg.train.seq_len}, micro-batch {cfg.train.micro_batch_size}, tp={cfg.parallel.tp}, "
                 f"pp={cfg.parallel.pp}")
        path = plot_recompute_sweep(rows, cfg.model.num_layers, args.png, title)
        if not args.json:
            print(f"wrote {path}")
    return 0


def _run_sweep(args, cfg, sweep) -> int:
    if args.sweep == "recompute":
        return _run_recompute_sweep(args, cfg)

    values = [int(v) for v in args.values.split(",")] if args.values else _sweep_values(cfg, args.sweep)
    result = sweep(cfg, args.sweep, values, device=args.device)
    # Log-log slope between the last two points: ~2 means quadratic, ~1 linear.
    slopes = {k: math.log(result[k][-1] / result[k][-2]) / math.log(values[-1] / values[-2]) for k in ("eager", "sdpa")}
    sdpa_cfg = copy.deepcopy(cfg)
    sdpa_cfg.model.attention = "sdpa"
    fallback = scores_materialised(sdpa_cfg, args.device)
    if args.json:
        print(json.dumps({**result, "key": args.sweep, "loglog_slope": slopes}, indent=2))
    else:
        name = {"seq": "seq_len", "batch": "micro_batch"}[args.sweep]
        print(f"{name:>12s} {'eager':>14s} {'sdpa':>14s}")
        for v, e, s in zip(values, result["eager"], result["sdpa"]):
            print(f"{v:>12d} {human_bytes(e):>14s} {human_bytes(s):>14s}")
        print(f"log-log slope of the last step: eager {slopes['eager']:.2f}, sdpa {slopes['sdpa']:.2f} "
              f"(1 = linear, 2 = quadratic)")
        if fallback:
            print(f"note: on {args.device}, SDPA has no flash kernel for this dtype/mask with GQA and falls back to "
                  f"the math kernel, which stores the scores; try --set train.precision=bf16-mixed")
    if args.png:
        what = {"seq": "sequence length", "batch": "micro-batch size"}[args.sweep]
        fixed = f"seq {cfg.train.seq_len}" if args.sweep == "batch" else f"micro-batch {cfg.train.micro_batch_size}"
        title = (f"{model_name(cfg)}: activation memory per rank vs {what}\n{cfg.train.precision}, "
                 f"recompute={cfg.train.recompute}, {fixed}, tp={cfg.parallel.tp}, cp={cfg.parallel.cp}")
        path = plot_sweep(result, args.sweep, args.png, title)
        if not args.json:
            print(f"wrote {path}")
    return 0


def run_memory(args) -> int:
    cfg = config_from_args(args)
    if args.steps < 1:
        raise SystemExit("fivefold memory: --steps must be at least 1")
    world = int(os.environ.get("WORLD_SIZE", max(args.nproc, 1)))
    if not 0 <= args.rank < world:
        raise SystemExit(f"fivefold memory: --rank {args.rank} is not one of the {world} ranks")
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return launch_workers(cfg, args.nproc, sys.argv[1:], "memory")
    datasets = random_datasets(cfg) if args.synthetic else None
    timeline = measure_memory(cfg, steps=args.steps, datasets=datasets, cuda_history=args.cuda_history)
    if int(os.environ.get("RANK", "0")) != args.rank:
        return 0
    if args.png:
        t = cfg.train
        plot_timeline(timeline, args.png, f"{model_name(cfg)}: memory of the first {args.steps} training steps "
                      f"({timeline.device})\n{t.precision}, recompute={t.recompute}, attention={cfg.model.attention}, "
                      f"micro-batch {t.micro_batch_size} x seq {t.seq_len}, grad_accum {t.grad_accum}")
    if args.json:
        print(timeline.dumps())
        return 0
    rank = f" (rank {args.rank} of {os.environ['WORLD_SIZE']})" if "WORLD_SIZE" in os.environ else ""
    print(f"measured {args.steps} steps on {timeline.device}{rank}: {len(timeline.samples)} ops; predicted = "
          f"fivefold plan --device {timeline.device}")
    print(timeline.table())
    if args.png:
        print(f"wrote {args.png}")
    return 0
