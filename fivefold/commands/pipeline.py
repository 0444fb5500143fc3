"""CLI: `fivefold pipeline`, the schedule picture, planned (from the action lists) or measured (a real run)."""

from __future__ import annotations

import json
import os
import sys

from fivefold.commands.args import add_config_args, config_from_args, positive_int
from fivefold.config import ConfigError
from fivefold.memory.tracker import random_datasets
from fivefold.parallel.launch import launch_workers
from fivefold.parallel.pipeline_schedules import Action, Timeline, build_schedule, draw, simulate, theoretical_bubble
from fivefold.train.trainer import Trainer


THEORY = {"afab": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v m)", "zero-bubble": "(p-1)/(3m)"}


def register(sub) -> None:
    p = sub.add_parser("pipeline", help="draw a pipeline schedule as a per-rank timeline, planned or measured")
    add_config_args(p)
    p.add_argument("--pp", type=positive_int, help="pipeline ranks (default: parallel.pp)")
    p.add_argument("--microbatches", type=positive_int, help="micro-batches per step (default: train.grad_accum)")
    p.add_argument("--schedule", help="afab, 1f1b, interleaved or zero-bubble (default: parallel.pp_schedule)")
    p.add_argument("--virtual", type=positive_int, help="chunks per rank for interleaved (default: parallel.pp_virtual_stages)")
    p.add_argument("--png", help="write the picture here")
    p.add_argument("--actions", action="store_true", help="print each rank's action list")
    p.add_argument("--measure", action="store_true",
                   help="run real training steps under torchrun and draw their measured timeline")
    p.add_argument("--steps", type=positive_int, default=3, help="with --measure: steps to run; the last one is drawn")
    p.add_argument("--json", action="store_true", help="print the bubble figures as JSON")
    p.set_defaults(func=run_pipeline)


def _layout(args):
    cfg = config_from_args(args)
    par = cfg.parallel
    par.pp = args.pp or par.pp
    par.pp_schedule = args.schedule or par.pp_schedule
    par.pp_virtual_stages = args.virtual or (par.pp_virtual_stages if par.pp_schedule == "interleaved" else 1)
    if par.pp_schedule == "interleaved" and par.pp_virtual_stages == 1 and not args.virtual:
        par.pp_virtual_stages = 2
    cfg.train.grad_accum = args.microbatches or cfg.train.grad_accum
    return cfg


def run_pipeline(args) -> int:
    cfg = _layout(args)
    par, m = cfg.parallel, cfg.train.grad_accum
    if args.measure:
        return _measure(args, cfg)
    if par.pp < 2:
        raise ConfigError("fivefold pipeline needs --pp (or parallel.pp) of at least 2")
    lists = build_schedule(par.pp_schedule, par.pp, m, par.pp_virtual_stages)
    timeline = simulate(lists)
    theory = theoretical_bubble(par.pp_schedule, par.pp, m, par.pp_virtual_stages)
    report = {"schedule": par.pp_schedule, "pp": par.pp, "microbatches": m, "virtual": par.pp_virtual_stages,
              "bubble_simulated": timeline.bubble, "bubble_theory": theory}
    if args.actions:
        for rank, actions in enumerate(lists):
            print(f"rank {rank}: " + " ".join(map(str, actions)))
    if args.png:
        draw(timeline, args.png, f"{par.pp_schedule}: pp={par.pp}, {m} micro-batches"
             + (f", v={par.pp_virtual_stages}" if par.pp_schedule == "interleaved" else "")
             + f" (bubble {timeline.bubble:.3f})")
    _report(args, report)
    return 0


def _report(args, report: dict) -> None:
    if args.json:
        print(json.dumps(report, indent=2))
        return
    line = (f"{report['schedule']}: pp={report['pp']}, {report['microbatches']} micro-batches: bubble "
            f"{report.get('bubble_measured', report.get('bubble_simulated')):.3f} "
            f"({'measured' if 'bubble_measured' in report else 'simulated, unit costs'}); "
            f"{THEORY[report['schedule']]} theory {report['bubble_theory']:.3f}")
    print(line)
    if args.png:
        print(f"wrote {args.png}")


def _measure(args, cfg) -> int:
    """Under torchrun: train a few steps, gather the last step's per-action times of every pipeline rank
    (dp rank 0, tp rank 0), and draw them; bubble = idle / busy on the busiest rank."""
    if cfg.parallel.world_size > 1 and "LOCAL_RANK" not in os.environ:
        return launch_workers(cfg, cfg.parallel.world_size, [*sys.argv[1:], *_layout_args(cfg)], "pipeline")
    import tempfile

    import torch.distributed as dist

    cfg.train.tensorboard, cfg.train.progress = False, False
    cfg.train.peak_flops = cfg.train.peak_flops or 1.0
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, out_dir=out, quiet=True, datasets=random_datasets(cfg))
        if trainer.parallel.pipeline is None:
            raise SystemExit("fivefold pipeline --measure: set parallel.pp >= 2")
        for _ in range(args.steps):
            trainer.mesh.barrier()
            trainer.train_step()
        mine = [(a.kind, a.mb, a.chunk, s, e) for a, s, e in trainer.parallel.pipeline.timeline]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (trainer.mesh.pp_rank, trainer.mesh.dp_rank, trainer.mesh.tp_rank, mine))
    if dist.get_rank() != 0:
        return 0
    events = [(pp_rank, Action(k, mb, c), s, e) for pp_rank, dp_rank, tp_rank, acts in everyone
              if dp_rank == 0 and tp_rank == 0 for k, mb, c, s, e in acts]
    timeline = Timeline(events, cfg.parallel.pp)
    par = cfg.parallel
    report = {"schedule": par.pp_schedule, "pp": par.pp, "microbatches": cfg.train.grad_accum,
              "virtual": par.pp_virtual_stages, "bubble_measured": timeline.bubble,
              "bubble_theory": theoretical_bubble(par.pp_schedule, par.pp, cfg.train.grad_accum,
                                                  par.pp_virtual_stages),
              "step_seconds": timeline.makespan}
    if args.png:
        draw(timeline, args.png, f"measured {par.pp_schedule}: pp={par.pp}, {cfg.train.grad_accum} micro-batches "
             f"(bubble {timeline.bubble:.3f}, step {timeline.makespan * 1e3:.0f} ms)")
    _report(args, report)
    return 0


def _layout_args(cfg) -> list[str]:
    """The resolved layout, passed to the workers explicitly."""
    p = cfg.parallel
    return ["--set", f"parallel.pp={p.pp}", "--set", f"parallel.pp_schedule={p.pp_schedule}",
            "--set", f"parallel.pp_virtual_stages={p.pp_virtual_stages}", "--set", f"train.grad_accum={cfg.train.grad_accum}"]
