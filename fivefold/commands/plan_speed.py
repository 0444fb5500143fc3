"""The speed half of `fivefold plan`: `--cluster PROFILE` adds the predicted step time to the memory plan,
`--gpus N` and `--global-batch TOKENS` place the config's layout on N devices, `--search` ranks every
layout that fits (fivefold.planner.search)."""

from __future__ import annotations

import copy
import json
import re

from fivefold.commands.args import positive_int
from fivefold.config import Config, ConfigError
from fivefold.memory.units import human_bytes
from fivefold.planner.plots import plot_breakdown
from fivefold.planner.search import search_layouts, why_first
from fivefold.planner.speed import kernel_time, predict_step


def add_arguments(plan) -> None:
    plan.add_argument("--gpus", type=positive_int, metavar="N",
                      help="with --cluster: devices to plan for; parallel.dp grows to fill them (tp, pp, cp kept)")
    plan.add_argument("--global-batch", metavar="TOKENS",
                      help="tokens per optimizer step, e.g. 4M (4e6), 4Mi (2^22) or 1048576; default: the "
                           "config's micro_batch_size x grad_accum x dp x seq_len, with --gpus's dp")
    plan.add_argument("--search", action="store_true",
                      help="with --cluster: rank every layout (dp, tp, pp, cp, ep, zero, schedule, recompute, "
                           "micro-batch) that fits the device memory by predicted tokens/s per GPU")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="with --search: show the best K (default 10)")


def parse_tokens(text: str) -> int:
    """'4M' -> 4_000_000, '4Mi' -> 4_194_304, '1048576' -> 1_048_576."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([KMG]?)(i?)\s*", str(text), re.IGNORECASE)
    value = 0.0
    if match and (match.group(2) or not match.group(3)):
        value = float(match.group(1)) * (1024 if match.group(3) else 1000) ** ("KMG".find(match.group(2).upper()) + 1
                                                                               if match.group(2) else 0)
    if value < 1 or value != int(value):
        raise ConfigError(f"--global-batch {text!r}: write a whole number of tokens like 4M, 4Mi or 1048576")
    return int(value)


def global_batch_tokens(cfg: Config, text: str | None) -> int:
    t, p = cfg.train, cfg.parallel
    return parse_tokens(text) if text else t.micro_batch_size * t.grad_accum * p.dp * t.seq_len


def placed(cfg: Config, gpus: int | None, batch_tokens: int | None) -> Config:
    """The config on `gpus` devices (dp = gpus / (tp pp cp)) with grad_accum giving `batch_tokens`; without
    it, each rank keeps its micro-batches and the global batch grows with dp."""
    new = copy.deepcopy(cfg)
    t, p = new.train, new.parallel
    if gpus is not None:
        model_parallel = p.tp * p.pp * p.cp
        if gpus < 1 or gpus % model_parallel:
            raise ConfigError(f"--gpus {gpus} is not a multiple of tp x pp x cp = {model_parallel}; use a multiple "
                              f"of {model_parallel}, or --search to choose the layout")
        p.dp = gpus // model_parallel
    per_step = t.micro_batch_size * p.dp * t.seq_len
    if batch_tokens is None:
        return new
    if batch_tokens % per_step:
        raise ConfigError(f"a global batch of {batch_tokens:,} tokens is not a whole number of micro-batches of "
                          f"micro_batch_size x dp x seq_len = {t.micro_batch_size} x {p.dp} x {t.seq_len} tokens; "
                          f"use a multiple of {per_step:,} (--global-batch), or change train.micro_batch_size")
    t.grad_accum = batch_tokens // per_step
    return new


def run_speed(args, cfg: Config, plan, profile) -> None:
    """Print the memory plan with its predicted speed (the layout as configured, placed on --gpus)."""
    speed = predict_step(cfg, profile)
    # One stage's device time by kernel kind: what a profiled step (bench/train_throughput.py --profile) sums
    kinds = kernel_time(cfg, profile) if cfg.parallel.pp == 1 else None
    if args.json:
        print(json.dumps({**plan.to_json(), "speed": {**speed.to_json(), "kernels_s": kinds}}, indent=2))
    else:
        print(plan.table())
        print()
        print(speed.table())
        if kinds:
            print("  device time by kernel kind: " + ", ".join(f"{kind} {v * 1e3:.1f} ms" for kind, v in kinds.items()))


def run_search(args, cfg: Config, profile, device_memory) -> int:
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: show at least 1 layout")
    gpus = args.gpus or cfg.parallel.world_size
    tokens = global_batch_tokens(cfg, args.global_batch)
    result = search_layouts(cfg, profile, gpus, tokens, top=args.top, device_memory=device_memory)
    limit = device_memory or profile.memory_bytes
    if not result.ranked:
        raise ConfigError(f"no layout of this model fits {gpus} x {profile.name} ({human_bytes(limit)} each) with a "
                          f"global batch of {tokens:,} tokens ({result.meshes} dp x tp x pp x cp splits tried): add "
                          f"devices, shorten train.seq_len or change the global batch")
    reason = why_first(result.ranked[0], result.ranked[1]) if len(result.ranked) > 1 else ""
    if args.json:
        print(json.dumps({"gpus": gpus, "profile": profile.name, "global_batch_tokens": tokens,
                          "device_memory": limit, "meshes": result.meshes, "costed": result.costed,
                          "fitting": result.fitting, "seconds": result.seconds, "why_first": reason,
                          "ranked": [{"layout": c.layout(), "set": c.overrides(), "memory": int(c.memory),
                                      "speed": c.speed.to_json()} for c in result.ranked]}, indent=2))
    else:
        print(f"{gpus} x {profile.name} ({human_bytes(limit)} each), global batch {tokens:,} tokens of seq "
              f"{cfg.train.seq_len}: {result.fitting} layouts fit, of {result.meshes} dp x tp x pp x cp splits "
              f"({result.seconds:.1f} s)")
        print(f"{'#':>3s} {'tok/s/GPU':>10s} {'MFU':>6s} {'step':>9s} {'memory':>9s}  layout")
        for i, c in enumerate(result.ranked, 1):
            s = c.speed
            print(f"{i:>3d} {s.tokens_per_s_per_gpu:>10,.0f} {100 * s.mfu:>5.1f}% {s.step_time_s:>8.2f}s "
                  f"{human_bytes(c.memory):>9s}  {_short(c.layout())}")
        if reason:
            print(reason)
        print("run #1 with: " + " ".join(f"--set {o}" for o in result.ranked[0].overrides().split()))
    if args.png:
        path = plot_breakdown(result.ranked, args.png, f"{gpus} x {profile.name}: where the step goes, best "
                                                       f"{len(result.ranked)} layouts")
        if not args.json:
            print(f"wrote {path}")
    return 0


def _short(layout: dict) -> str:
    parts = [f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} cp{layout['cp']}"
             + (f" ep{layout['ep']}" if layout["ep"] > 1 else ""), f"zero{layout['zero']}"]
    if layout["pp"] > 1:
        parts.append(layout["pp_schedule"] + (f"(v{layout['pp_virtual_stages']})" if layout["pp_virtual_stages"] > 1
                                              else ""))
    parts += [f"recompute={layout['recompute']}", f"mbs{layout['micro_batch_size']} x {layout['grad_accum']}"]
    return " ".join(parts)
