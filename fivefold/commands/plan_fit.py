"""`fivefold plan --fit`: the micro-batch and recomputation that fill the device memory (fivefold.planner.fit
chooses; this prints the choice, the --set flags and the candidates, or one JSON object)."""

from __future__ import annotations

import json

from fivefold.commands.plan_speed import parse_tokens
from fivefold.config import Config, ConfigError
from fivefold.memory.plan import model_name
from fivefold.memory.units import human_bytes
from fivefold.planner.fit import RECOMPUTE, FitCandidate, FitResult, fit_micro_batch
from fivefold.planner.hardware import HardwareProfile


def add_arguments(plan) -> None:
    plan.add_argument("--fit", action="store_true",
                      help="choose train.micro_batch_size and train.recompute that fill the device memory "
                           "(--device-memory or --cluster) for this layout; with --cluster, by predicted tokens/s")
    plan.add_argument("--headroom", type=float, metavar="FRACTION",
                      help="with --fit: the fraction of the device memory left free (default 0.05)")
    plan.add_argument("--grow-batch", action="store_true",
                      help="with --fit: keep train.grad_accum and let the global batch grow with the micro-batch "
                           "(default: keep the global batch)")



def run_fit(args, cfg: Config, device_memory: int | None, profile: HardwareProfile | None) -> int:
    """`fivefold plan --fit`: print the choice, the --set flags, and the candidates (or one JSON object)."""
    clash = [flag for flag, on in (("--search", args.search), ("--sweep", args.sweep), ("--serve", args.serve),
                                   ("--gpus", args.gpus), ("--png", args.png)) if on]
    if clash:
        raise ConfigError(f"--fit keeps the config's layout and prints a choice; drop {', '.join(clash)} (set "
                          f"parallel.* with --set, or use --search to choose the layout)")
    if device_memory is None:
        raise ConfigError("--fit fills the device memory: give it with --device-memory 80GB or --cluster PROFILE "
                          "(or --device cpu for this host's)")
    if args.grow_batch and args.global_batch:
        raise ConfigError("--grow-batch lets the global batch follow the micro-batch, --global-batch fixes it: "
                          "give one of them")
    result = fit_micro_batch(cfg, device_memory, device=args.device,
                             headroom=0.05 if args.headroom is None else args.headroom, profile=profile,
                             global_batch_tokens=parse_tokens(args.global_batch) if args.global_batch else None,
                             grow=args.grow_batch)
    if args.json:
        print(json.dumps(_to_json(result, cfg, args.device, profile), indent=2))
        return 0
    print("\n".join(_report(result, cfg, args.device, profile)))
    return 0


def _batch_line(result: FitResult, cfg: Config) -> str:
    t, dp = result.config.train, cfg.parallel.dp
    if result.sequences_per_rank is None:
        was = cfg.global_batch_tokens
        return (f"global batch follows the micro-batch (--grow-batch, grad_accum {t.grad_accum} kept); it was "
                f"{was:,} tokens, and train.lr was set for that one")
    n = result.sequences_per_rank
    tokens = n * dp * t.seq_len
    what = ("kept" if tokens == cfg.global_batch_tokens
            else f"from --global-batch (the config's: {cfg.global_batch_tokens:,} tokens)")
    return (f"global batch {what}: {n} sequences per rank (micro_batch_size x grad_accum) x dp {dp} = {n * dp} "
            f"sequences of {t.seq_len} tokens ({tokens:,} tokens)")


def _report(result: FitResult, cfg: Config, device: str, profile: HardwareProfile | None) -> list[str]:
    c = result.chosen
    lines = [f"{model_name(cfg)}, {cfg.train.precision}, seq {cfg.train.seq_len}, dp={cfg.parallel.dp} "
             f"tp={cfg.parallel.tp} pp={cfg.parallel.pp} cp={cfg.parallel.cp} zero={cfg.parallel.zero}: fit in "
             f"{human_bytes(result.limit)} per rank ({human_bytes(result.device_memory)} less "
             f"{result.headroom:.0%} headroom; {device} kernels)", _batch_line(result, cfg), ""]
    speed = profile is not None
    header = (f"  {'recompute':<10s} {'+FLOPs':>7s} {'micro-batch':>11s} {'grad_accum':>10s} {'memory':>10s} "
              f"{'of limit':>8s}  {'':<12s}" + (f" {'tok/s/GPU':>10s} {'MFU':>6s}" if speed else ""))
    lines.append(header.rstrip())
    for row in _shown(result):
        mark = "*" if row is c else " "
        verdict = "fits" if row.fits else "does not fit"
        text = (f"{mark} {row.recompute:<10s} {100 * row.recompute_flops:>6.1f}% {row.micro_batch_size:>11d} "
                f"{row.grad_accum:>10d} {human_bytes(row.memory):>10s} {100 * row.memory / result.limit:>7.1f}%  "
                f"{verdict:<12s}")
        if speed and row.speed is not None:
            text += f" {row.speed.tokens_per_s_per_gpu:>10,.0f} {100 * row.speed.mfu:>5.1f}%"
        lines.append(text.rstrip())
    hidden = len(result.candidates) - len(_shown(result))
    if hidden:
        lines.append(f"  ({hidden} more with smaller micro-batches; --json lists every candidate)")
    why = (f"the highest predicted tokens/s on {profile.name}" if speed
           else "the fewest recomputed FLOPs, then the largest micro-batch")
    lines += ["", f"chosen ({why}): train.recompute={c.recompute}, micro_batch_size {c.micro_batch_size}, "
                  f"grad_accum {c.grad_accum}, {human_bytes(c.memory)}"
                  + (f", train.fused_projections={c.fused_projections}" if c.fused_projections else "")]
    if result.changes:
        lines.append("changes: " + ", ".join(f"{k} {was!r} -> {now!r}" if isinstance(was, str) else
                                            f"{k} {was} -> {now}" for k, (was, now) in result.changes.items()))
    else:
        lines.append("changes: none, the config already has these settings")
    if result.sequences_per_rank is None and result.config.global_batch_tokens != cfg.global_batch_tokens:
        lines.append(f"global batch: {cfg.global_batch_tokens:,} -> {result.config.global_batch_tokens:,} tokens")
    if result.capped:
        largest = max(x.micro_batch_size for x in result.candidates if x.recompute == c.recompute)
        lines.append(f"note: micro_batch_size={largest}, the largest the global batch allows, fits; to fill more "
                     f"memory, raise the global batch (--global-batch TOKENS) or let it grow (--grow-batch)")
    lines.append("run with: " + " ".join(f"--set {o}" for o in result.overrides()))
    return lines


def _shown(result: FitResult) -> list[FitCandidate]:
    """A short table: per recomputation mode its three largest micro-batches that fit and the smallest that
    does not, and the chosen candidate."""
    rows = []
    for mode in RECOMPUTE:
        mine = [c for c in result.candidates if c.recompute == mode]  # by micro-batch
        fitting = [c for c in mine if c.fits][-3:]
        over = [c for c in mine if not c.fits and all(c.micro_batch_size > f.micro_batch_size for f in fitting)][:1]
        keep = {id(c) for c in fitting + over + [result.chosen]}
        rows += [c for c in mine if id(c) in keep]
    return rows


def _to_json(result: FitResult, cfg: Config, device: str, profile: HardwareProfile | None) -> dict:
    t = result.config.train
    return {"model": model_name(cfg), "device": device, "profile": profile.name if profile else None,
            "device_memory": result.device_memory, "headroom": result.headroom, "limit": int(result.limit),
            "ranked_by": "predicted tokens/s" if profile else "recomputed FLOPs, then micro-batch size",
            "global_batch": {"kept": result.sequences_per_rank is not None,
                             "sequences_per_rank": t.micro_batch_size * t.grad_accum,
                             "tokens": result.config.global_batch_tokens, "was_tokens": cfg.global_batch_tokens},
            "chosen": result.chosen.to_json(), "set": result.overrides(),
            "changes": {k: list(v) for k, v in result.changes.items()}, "capped_by_global_batch": result.capped,
            "candidates": [c.to_json() for c in result.candidates]}
