"""`fivefold plan --fit`: the micro-batch size and recomputation that fill one device's memory, for the
config's layout (dp, tp, pp, cp, ep, ZeRO and precision stay as configured).

Candidates: each recomputation mode (none, selective, ops, full; on every layer) with micro-batch sizes that
are powers of two, and the largest whole number that fits. A candidate fits when the memory plan's total on
the most loaded rank (fivefold.memory.plan.plan_memory) is within the device memory less the headroom.

The global batch is kept: each rank's sequences per step (micro_batch_size x grad_accum, or --global-batch
over dp x seq_len) must be a multiple of the micro-batch, and grad_accum makes up the rest; under pipeline
parallelism grad_accum stays >= pp (fewer micro-batches than stages leave the pipeline idle). --grow-batch
keeps grad_accum instead, and the global batch grows with the micro-batch.

Among those that fit, without a speed model: the fewest recomputed FLOPs, then the largest micro-batch
(larger matmuls run nearer the peak: the knee of fivefold.planner.speed). With a speed model (--cluster):
the highest predicted tokens/s (fivefold.planner.speed.predict_step), which weighs the two against each other;
then, for the chosen candidate, train.fused_projections too (separate, q/k/v fused, or q/k/v and gate/up fused:
the thinner separate products sit lower on the matmul knee, the fused ones concatenate their weights each
pass), where it still fits.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError
from fivefold.memory import formulas
from fivefold.memory.plan import plan_memory
from fivefold.memory.units import human_bytes
from fivefold.planner.hardware import HardwareProfile
from fivefold.planner.speed import SpeedPlan, predict_step, recomputed_matmul_share

RECOMPUTE = ("none", "selective", "ops", "full")
LARGEST = 1 << 24  # sequences per micro-batch: a bound on --grow-batch's doubling, never reached in practice


@dataclass
class FitCandidate:
    recompute: str
    micro_batch_size: int
    grad_accum: int
    memory: float  # planned peak bytes on the most loaded rank
    fits: bool
    recompute_flops: float  # recomputed FLOPs / the step's model FLOPs
    speed: SpeedPlan | None = None
    fused_projections: str = ""  # train.fused_projections chosen with a speed model; "": as configured

    def to_json(self) -> dict:
        out = {"recompute": self.recompute, "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
               "memory": int(self.memory), "fits": self.fits, "recompute_flops_fraction": self.recompute_flops}
        if self.fused_projections:
            out["fused_projections"] = self.fused_projections
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
        out += [f"train.fused_projections={t.fused_projections}"] if "train.fused_projections" in self.changes else []
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
        fastest = _fastest_projections(base, chosen, profile, limit, device)
        candidates[candidates.index(chosen)] = chosen = fastest  # its row in the table: the setting chosen
    else:
        chosen = min(fitting, key=lambda c: (c.recompute_flops, -c.micro_batch_size))
    new = _with(cfg, chosen)
    if cfg.train.recompute_layers:
        new.train.recompute_layers = ""
    changes = {key: (getattr(cfg.train, key), getattr(new.train, key))
               for key in ("micro_batch_size", "grad_accum", "recompute", "recompute_layers", "fused_projections")
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
    t.fused_projections = c.fused_projections or t.fused_projections
    return new


def _fastest_projections(base: Config, chosen: FitCandidate, profile: HardwareProfile, limit: float,
                         device: str) -> FitCandidate:
    """`chosen` with the train.fused_projections that the speed model puts fastest and that still fits (the
    fused products' concatenated weights are transient memory); a tie keeps the configured setting."""
    best, configured = chosen, _with(base, chosen).fused_projections(device)
    for setting in ("false", "auto", "true"):
        if setting == base.train.fused_projections or (setting == "true" and chosen.recompute == "ops"):
            continue  # the configured one is `chosen`; true and ops do not combine (Config validation)
        c = dataclasses.replace(chosen, fused_projections=setting)
        cfg = _with(base, c)
        if cfg.fused_projections(device) == configured:
            continue  # the same products run (e.g. auto on a CPU is false)
        c.memory = plan_memory(cfg, device=device, suggest=False).memory["total"]
        c.speed = predict_step(cfg, profile)
        if c.memory <= limit and c.speed.tokens_per_s_per_gpu > best.speed.tokens_per_s_per_gpu:
            best = c
    return best


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
