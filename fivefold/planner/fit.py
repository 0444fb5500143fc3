"""`fivefold plan --fit`: the micro-batch size and recomputation that fill one device's memory, for the
config's layout (dp, tp, pp, cp, ep, ZeRO and precision stay as configured).

Candidates: each recomputation mode (none, selective, ops, full; on every layer) with micro-batch sizes that
are powers of two, and the largest whole number that fits. A candidate fits when the memory plan's total on
the most loaded rank (fivefold.memory.planner.plan_memory) is within the device memory less the headroom.

The global batch is kept: each rank's sequences per step (micro_batch_size x grad_accum, or --global-batch
over dp x seq_len) must be a multiple of the micro-batch, and grad_accum makes up the rest; under pipeline
parallelism grad_accum stays >= pp (fewer micro-batches than stages leave the pipeline idle). --grow-batch
keeps grad_accum instead, and the global batch grows with the micro-batch.

Among those that fit, without a speed model: the fewest recomputed FLOPs, then the largest micro-batch
(larger matmuls run nearer the peak: the knee of fivefold.planner.speed). With a speed model (--cluster):
the highest predicted tokens/s (fivefold.planner.speed.predict_step), which weighs the two against each other.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError
from fivefold.memory import formulas
from fivefold.memory.planner import model_name, plan_memory
from fivefold.memory.plots import human_bytes
from fivefold.planner.hardware import HardwareProfile
from fivefold.planner.speed import SpeedPlan, predict_step, recomputed_matmul_share

RECOMPUTE = ("none", "selective", "ops", "full")
LARGEST = 1 << 24  # sequences per micro-batch: a bound on --grow-batch's doubling, never reached in practice


def add_arguments(plan) -> None:
    plan.add_argument("--fit", action="store_true",
                      help="choose train.micro_batch_size and train.recompute that fill the device memory "
                           "(--device-memory or --cluster) for this layout; with --cluster, by predicted tokens/s")
    plan.add_argument("--headroom", type=float, metavar="FRACTION",
                      help="with --fit: the fraction of the device memory left free (default 0.05)")
    plan.add_argument("--grow-batch", action="store_true",
                      help="with --fit: keep train.grad_accum and let the global batch grow with the micro-batch "
                           "(default: keep the global batch)")


@dataclass
class FitCandidate:
    recompute: str
    micro_batch_size: int
    grad_accum: int
    memory: float  # planned peak bytes on the most loaded rank
    fits: bool
    recompute_flops: float  # recomputed FLOPs / the step's model FLOPs
    speed: SpeedPlan | None = None

    def to_json(self) -> dict:
        out = {"recompute": self.recompute, "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
               "memory": int(self.memory), "fits": self.fits, "recompute_flops_fraction": self.recompute_flops}
        if self.speed is not None:
            out.update(tokens_per_s_per_gpu=self.speed.tokens_per_s_per_gpu, mfu=self.speed.mfu,
                       step_time_s=self.speed.step_time_s)
        return out


@dataclass
class FitResult:
    chosen: FitCandidate
    candidates: list[FitCandidate]  # every one planned, by recompute mode then micro-batch
    config: Config  # the given config with the chosen settings
    device_memory: int
    headroom: float
    sequences_per_rank: int | None  # the kept global batch per data-parallel rank; None: --grow-batch
    capped: bool  # the largest micro-batch the kept batch allows fits: a larger global batch would fill more
    changes: dict[str, tuple] = field(default_factory=dict)  # key -> (was, now)

    @property
    def limit(self) -> float:
        return self.device_memory * (1 - self.headroom)

    def overrides(self) -> list[str]:
        """The chosen settings as `key=value` for `fivefold train --set`."""
        t = self.config.train
        out = [f"train.micro_batch_size={t.micro_batch_size}", f"train.grad_accum={t.grad_accum}",
               f"train.recompute={t.recompute}"]
        return out + (["train.recompute_layers="] if "train.recompute_layers" in self.changes else [])


def recomputed_flops(cfg: Config, mode: str) -> float:
    """FLOPs train.recompute=`mode` runs again, as a fraction of the step's model FLOPs (formulas.flops_per_token):
    full replays each layer's forward (its matmuls and the attention core), selective the attention core, ops
    every other matmul (speed.recomputed_matmul_share) and, under eager attention, the core (its scores are
    not kept). Counts per token and layer as flops_per_token's: 2 per matmul weight, 4 s q_size for the core."""
    m, seq = cfg.model, cfg.train.seq_len
    core = 4 * seq * m.q_size
    matmuls = 2 * (formulas.matmul_params(m) - m.vocab_size * m.hidden_size) / m.num_layers  # the LM head's aside
    eager = m.attention == "eager" and cfg.parallel.cp == 1
    per_layer = {"none": 0.0, "selective": core, "full": matmuls + core,
                 "ops": matmuls * recomputed_matmul_share(m) + (core if eager else 0.0)}[mode]
    return m.num_layers * per_layer / formulas.flops_per_token(m, seq)


def sequences_per_rank(cfg: Config, global_batch_tokens: int | None) -> int:
    """Sequences each data-parallel rank takes per optimizer step: the config's, or --global-batch's."""
    t, dp = cfg.train, cfg.parallel.dp
    if global_batch_tokens is None:
        return t.micro_batch_size * t.grad_accum
    per_rank = t.seq_len * dp
    if global_batch_tokens % per_rank:
        raise ConfigError(f"--global-batch {global_batch_tokens:,} tokens is not a whole number of sequences per "
                          f"data-parallel rank (seq_len x dp = {t.seq_len} x {dp}); use a multiple of {per_rank:,}")
    return global_batch_tokens // per_rank


def fit_micro_batch(cfg: Config, device_memory: int, device: str = "cuda", headroom: float = 0.05,
                    profile: HardwareProfile | None = None, global_batch_tokens: int | None = None,
                    grow: bool = False) -> FitResult:
    """The micro-batch size and recomputation that fit `device_memory` less `headroom` (a fraction) for
    `cfg`'s layout, chosen as the module docstring says; a ConfigError naming what to change if none fits."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom {headroom}: give the fraction of memory left free, in [0, 1), e.g. 0.05")
    t = cfg.train
    if t.batch_schedule.strip() or t.batch_ramp == "auto":
        raise ConfigError("--fit keeps one global batch, and train.batch_schedule / train.batch_ramp=auto change it "
                          "during the run: fit without them (--set train.batch_schedule= --set "
                          "train.batch_ramp=schedule), then scale their grad_accum values to the new micro-batch")
    limit = device_memory * (1 - headroom)
    base = copy.deepcopy(cfg)
    base.train.recompute_layers = ""  # each mode on every layer
    per_rank = None if grow else sequences_per_rank(cfg, global_batch_tokens)
    candidates = []
    for mode in RECOMPUTE:
        candidates += _mode_candidates(base, mode, per_rank, limit, device)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise ConfigError(_nothing_fits(cfg, candidates, device_memory, headroom))
    if profile is not None:
        for c in fitting:
            c.speed = predict_step(_with(base, c), profile)
        chosen = max(fitting, key=lambda c: c.speed.tokens_per_s_per_gpu)
    else:
        chosen = min(fitting, key=lambda c: (c.recompute_flops, -c.micro_batch_size))
    new = _with(cfg, chosen)
    if cfg.train.recompute_layers:
        new.train.recompute_layers = ""
    changes = {key: (getattr(cfg.train, key), getattr(new.train, key))
               for key in ("micro_batch_size", "grad_accum", "recompute", "recompute_layers")
               if getattr(cfg.train, key) != getattr(new.train, key)}
    # With the batch kept, each mode's last candidate is the largest micro-batch the batch allows.
    largest = [c for c in candidates if c.recompute == chosen.recompute][-1]
    return FitResult(chosen, candidates, new, device_memory, headroom, per_rank,
                     capped=per_rank is not None and largest.fits,
                     changes={f"train.{k}": v for k, v in changes.items()})


def _with(cfg: Config, c: FitCandidate) -> Config:
    new = copy.deepcopy(cfg)
    t = new.train
    t.recompute, t.micro_batch_size, t.grad_accum = c.recompute, c.micro_batch_size, c.grad_accum
    return new


def _mode_candidates(base: Config, mode: str, per_rank: int | None, limit: float, device: str) -> list[FitCandidate]:
    """One recomputation mode's candidates: the powers of two, and the largest micro-batch that fits."""
    share = recomputed_flops(base, mode)
    planned: dict[int, FitCandidate | None] = {}

    def plan(b: int) -> FitCandidate | None:  # None: not a config that runs (e.g. grad_accum vs pp)
        if b not in planned:
            accum = base.train.grad_accum if per_rank is None else per_rank // b
            c = FitCandidate(mode, b, accum, 0.0, False, share)
            try:
                c.memory = plan_memory(_with(base, c), device=device, suggest=False).memory["total"]
            except ConfigError:
                planned[b] = None
                return None
            c.fits = c.memory <= limit
            planned[b] = c
        return planned[b]

    def fits(b: int) -> bool:
        c = plan(b)
        return c is not None and c.fits

    if per_rank is not None:
        # The kept batch: micro-batches that divide it. Memory need not grow with them here (grad_accum falls
        # as they grow, and with it the accumulated gradients and the micro-batches a pipeline holds), so
        # every divisor is planned.
        pp = base.parallel.pp
        sizes = [b for b in range(1, per_rank + 1) if per_rank % b == 0
                 and (pp == 1 or per_rank < pp or per_rank // b >= pp)]
        # Shown beside the powers of two: the largest micro-batch allowed (pp = 1: the whole batch at once,
        # which holds no accumulated gradients).
        powers = [b for b in sizes if b & (b - 1) == 0] + sizes[-1:]
        largest = max((b for b in sizes if fits(b)), default=None)
    else:
        # grad_accum kept: memory grows with the micro-batch, so double to the first that does not fit, then
        # bisect between it and the last power that did.
        powers = [1]
        while fits(powers[-1]) and powers[-1] < LARGEST:
            powers.append(2 * powers[-1])
        largest = powers[-1] if fits(powers[-1]) else None
        if largest is None and len(powers) > 1:
            low, high = powers[-2], powers[-1]  # fits, does not
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
            largest = low
    shown = sorted(set(powers) | ({largest} if largest else set()))
    return [planned[b] for b in shown if plan(b) is not None]


def _nothing_fits(cfg: Config, candidates: list[FitCandidate], device_memory: int, headroom: float) -> str:
    limit = f"{human_bytes(device_memory * (1 - headroom))} ({human_bytes(device_memory)} less {headroom:.0%} headroom)"
    fix = ("give more memory (--device-memory), split the model with parallel.tp or parallel.pp, or shard its "
           "states over data-parallel ranks with parallel.zero=3")
    if not candidates:
        return f"no micro-batch of this layout is a valid config (see `fivefold plan`); nothing to fit in {limit}"
    least = min(candidates, key=lambda c: c.memory)
    return (f"nothing fits {limit}: the smallest plan, micro_batch_size={least.micro_batch_size} with "
            f"train.recompute={least.recompute}, needs {human_bytes(least.memory)} on the most loaded rank; {fix}")


# -- the command ------------------------------------------------------------------------------------------


def run_fit(args, cfg: Config, device_memory: int | None, profile: HardwareProfile | None) -> int:
    """`fivefold plan --fit`: print the choice, the --set flags, and the candidates (or one JSON object)."""
    from fivefold.planner.speed_commands import parse_tokens

    clash = [flag for flag, on in (("--search", args.search), ("--sweep", args.sweep), ("--serve", args.serve),
                                   ("--gpus", args.gpus), ("--png", args.png)) if on]
    if clash:
        raise ConfigError(f"--fit keeps the config's layout and prints a choice; drop {', '.join(clash)} (set "
                          f"parallel.* with --set, or use --search to choose the layout)")
    if device_memory is None:
        raise ConfigError("--fit fills the device memory: give it with --device-memory 80GB or --cluster PROFILE")
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
                  f"grad_accum {c.grad_accum}, {human_bytes(c.memory)}"]
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
