"""Per-rank process memory (RSS) of real training, at start-up and over the first steps, against the
memory planner's prediction (fivefold.memory.plan.plan_memory(cfg, device="cpu")).

    python bench/startup_memory.py --nproc 4 --layout zero3 --steps 2
    python bench/startup_memory.py --nproc 4 --layout tp2pp2 --steps 2
    python bench/startup_memory.py --layout single --set train.precision=fp32 --json /tmp/single.json

What is measured, per rank:
- baseline: VmRSS after torch, fivefold and the Trainer's module are imported and the random datasets
  are built, but before the Trainer exists. Trainer(...) starts the gloo process group itself, so the
  baseline does not include the process group (its buffers and threads count as start-up).
- start-up peak: the RSS high-water mark (VmHWM) while Trainer(...) builds the model, applies the
  layout, casts and shards it and creates the optimizer, minus the baseline. That is where transient
  full-size copies (an fp32 model before it is sharded, master weights cloned before the cast) show.
- steps peak: VmHWM over --steps calls of trainer.train_step(), minus the baseline.
VmHWM is reset before each phase by writing "5" to /proc/self/clear_refs. Without that (old kernel,
not Linux) the peaks are the high-water mark since the process started (fivefold.memory.host).

RSS is what the OS holds for the process, not what tensors hold. glibc normally keeps freed blocks for
reuse and raises its mmap threshold as large blocks are freed, so RSS would stay at an old peak. The
workers run with MALLOC_MMAP_THRESHOLD_=1048576: every block of 1 MiB or more is its own mapping,
returned to the OS when freed, so RSS follows live memory and the high-water mark is a real peak.
Planned start-up is the plan's "startup" entry where the planner has one ("n/a" otherwise); planned
steady is plan.stages[stage].memory["total"]. Ratios are measured / planned.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MODEL = {"model.vocab_size": 32000, "model.hidden_size": 1024, "model.num_layers": 20, "model.num_heads": 16,
         "model.num_kv_heads": 8, "model.ffn_hidden_size": 2816, "model.tie_embeddings": "false",
         "train.seq_len": 128, "train.micro_batch_size": 1, "train.precision": "bf16-mixed",
         "train.peak_flops": 1e12, "train.progress": "false", "train.tensorboard": "false",
         "train.device": "cpu"}  # 301.5M parameters; cpu because the plan below is the cpu one
LAYOUTS = {"zero3": (4, {"parallel.dp": 4, "parallel.zero": 3}),
           "tp2pp2": (4, {"parallel.tp": 2, "parallel.pp": 2, "parallel.pp_schedule": "1f1b",
                          "train.grad_accum": 2}),
           "single": (1, {})}
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="zero3")
    p.add_argument("--nproc", type=int, default=None, help="ranks; must match the layout (4, or 1 for single)")
    p.add_argument("--steps", type=int, default=2, help="train_step() calls measured after start-up")
    p.add_argument("--preset", default="demo")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (last wins)")
    p.add_argument("--json", default="", help="default: bench/results/startup_memory_<layout>.json")
    args = p.parse_args(argv)
    need = LAYOUTS[args.layout][0]
    if args.nproc not in (None, need):
        p.error(f"--layout {args.layout} runs on {need} process(es), not --nproc {args.nproc}")
    args.nproc = need
    args.json = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                          f"startup_memory_{args.layout}.json")
    return args


def make_config(args):
    from fivefold.config_load import load_config

    overrides = [f"{k}={v}" for k, v in {**MODEL, **LAYOUTS[args.layout][1]}.items()]
    return load_config(preset=args.preset, overrides=overrides + args.set)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fivefold.memory.plan import plan_memory  # noqa: F401 (all of fivefold's modules load now, together)
    from fivefold.memory import host
    from fivefold.memory.tracker import random_datasets
    from fivefold.train.trainer import Trainer  # imported here so the baseline holds its modules too

    torch.set_num_threads(1)
    cfg = make_config(args)
    datasets = random_datasets(cfg)
    baseline = host.resident()
    resettable = host.reset_resident_peak()
    out_dir = tempfile.mkdtemp(prefix="fivefold-bench-mem-")
    start = time.perf_counter()
    trainer = Trainer(cfg, out_dir=out_dir, quiet=True, datasets=datasets)
    startup_peak, startup_s = host.resident_peak(), time.perf_counter() - start
    rss_after_startup = host.resident()
    if trainer.mesh.is_main:  # a run takes minutes on a small CPU machine: show that it moves
        print(f"rank 0: start-up {startup_s:.0f} s, {startup_peak / MiB:.0f} MiB peak RSS", flush=True)
    resettable = resettable and host.reset_resident_peak()
    start = time.perf_counter()
    records = [trainer.train_step() for _ in range(args.steps)]
    steps_peak, steps_s = host.resident_peak(), time.perf_counter() - start
    mine = {"rank": trainer.mesh.rank, "stage": trainer.mesh.pp_rank, "baseline": baseline,
            "startup_peak": startup_peak, "startup_above_baseline": startup_peak - baseline,
            "rss_after_startup": rss_after_startup, "steps_peak": steps_peak,
            "steps_above_baseline": steps_peak - baseline, "rss_after_steps": host.resident(),
            "startup_s": startup_s, "steps_s": steps_s, "losses": [r["loss"] for r in records],
            "step_times_s": [r["step_time"] for r in records],
            "peak_source": "VmHWM, reset per phase" if resettable else "since process start (no reset)"}
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    shutil.rmtree(out_dir, ignore_errors=True)
    if trainer.mesh.is_main:
        report(args, cfg, ranks)


def planned(plan, stage: int) -> tuple[float | None, float]:
    """(start-up, steady total) for a stage; the plan's "startup" entry is newer than this script may be."""
    mem = plan.stages[stage].memory
    startup = mem.get("startup", plan.memory.get("startup"))
    return startup, mem["total"]


def report(args, cfg, ranks: list[dict]) -> None:
    from machine import base_info

    from fivefold.memory.plan import plan_memory

    plan = plan_memory(cfg, device="cpu")
    fmt = lambda v: "n/a" if v is None else f"{v / MiB:.0f}"  # noqa: E731
    ratio = lambda m, p: "n/a" if not p else f"{m / p:.2f}"  # noqa: E731
    print(f"\n{plan.params / 1e6:.1f}M params, layout {args.layout} ({len(ranks)} ranks), {cfg.train.precision}, "
          f"{args.steps} steps; MiB; peaks above the baseline; ratio = measured / planned")
    head = ("rank", "stage", "baseline", "startup", "plan", "ratio", "steps", "plan total", "ratio")
    print("{:>4} | {:>5} | {:>8} | {:>7} | {:>6} | {:>5} | {:>6} | {:>10} | {:>5}".format(*head))
    for r in sorted(ranks, key=lambda r: r["rank"]):
        plan_start, plan_total = planned(plan, r["stage"])
        r.update(planned_startup=plan_start, planned_total=plan_total,
                 startup_ratio=r["startup_above_baseline"] / plan_start if plan_start else None,
                 steps_ratio=r["steps_above_baseline"] / plan_total)
        print(f"{r['rank']:>4} | {r['stage']:>5} | {fmt(r['baseline']):>8} | {fmt(r['startup_above_baseline']):>7} | "
              f"{fmt(plan_start):>6} | {ratio(r['startup_above_baseline'], plan_start):>5} | "
              f"{fmt(r['steps_above_baseline']):>6} | {fmt(plan_total):>10} | "
              f"{ratio(r['steps_above_baseline'], plan_total):>5}")
    sources = {r["peak_source"] for r in ranks}
    print(f"peaks from: {', '.join(sorted(sources))}; start-up took {max(r['startup_s'] for r in ranks):.1f} s, "
          f"{args.steps} steps {max(r['steps_s'] for r in ranks):.1f} s (slowest rank)")
    out = {"machine": {**base_info(), "ranks": len(ranks), "malloc_mmap_threshold": os.environ.get(
               "MALLOC_MMAP_THRESHOLD_")},
           "settings": {k: v for k, v in vars(args).items() if k != "json"}, "ranks": ranks,
           "plan_stages": [{k: int(round(v)) for k, v in s.memory.items()} for s in plan.stages],
           "plan": plan.to_json()}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


def launch(argv: list[str], args) -> int:
    """Re-run this file under torchrun. The malloc setting must be in the environment before each worker
    starts: glibc reads it once, at start-up."""
    from fivefold.parallel.launch import torchrun_args, without_option
    from fivefold.parallel.mesh import check_supported

    from fivefold.memory.plan import plan_memory

    cfg = make_config(args)
    check_supported(cfg, args.nproc)  # a refused layout fails here, before any worker starts
    plan_memory(cfg, device="cpu")  # and so does a plan that cannot be made, before minutes of measuring
    cmd = [sys.executable, "-m", "torch.distributed.run",
           *torchrun_args(args.nproc, [os.path.abspath(__file__), *without_option(argv, "--nproc")])]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    code = subprocess.run(cmd, env=env).returncode
    print(f"total wall time {time.perf_counter() - start:.0f} s (exit {code})")
    return code


if __name__ == "__main__":
    parsed = parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(parsed)
        from fivefold.parallel.mesh import exit_worker

        exit_worker()  # gloo can abort the interpreter's own exit; this waits for all ranks and skips it
    else:
        sys.exit(launch(sys.argv[1:], parsed))
