"""`fivefold plan --search`: every legal layout of a model on N devices for a global batch, ranked by
predicted tokens/s per device among those that fit the device memory.

Enumerated: dp x tp x pp x cp (x ep for a mixture of experts) = N, ZeRO stage, pipeline schedule and
virtual stages, recomputation, micro-batch size (grad_accum follows from the global batch); every
candidate passes the same config validation a run does (heads divisible by tp, sequence by cp, ...).
Left out because they cannot win: AFAB (1F1B's step time with more memory held) and sequence parallel
off under tp (the same collectives, less activation memory on).

Most candidates are settled without costing them: for one mesh and schedule, a larger micro-batch never
needs less memory, more recomputation or a higher ZeRO stage never less time (the step-time model's
terms only grow), so for each micro-batch only the lowest ZeRO stage that fits is costed for each
recomputation mode, and the search stops growing the micro-batch at the first that fits nowhere.
Memory is the planner's own (fivefold.memory.plan) on the stages that can be the most loaded: the
first (most micro-batches in flight, the embeddings, the extra layers of an uneven split) and the last
(the LM head).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

from fivefold.config import Config, ConfigError
from fivefold.memory import formulas
from fivefold.memory.plan import stage_total
from fivefold.parallel.rules import check_implemented, check_layout
from fivefold.planner.hardware import HardwareProfile
from fivefold.planner.speed import SpeedPlan, predict_step

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (2, 4)
RECOMPUTE = ("none", "selective", "ops", "full")


@dataclass
class Candidate:
    cfg: Config
    speed: SpeedPlan
    memory: float  # bytes on the most loaded rank

    def layout(self) -> dict:
        p, t = self.cfg.parallel, self.cfg.train
        return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "zero": p.zero,
                "sequence_parallel": p.sequence_parallel,
                "pp_schedule": p.pp_schedule if p.pp > 1 else "-", "pp_virtual_stages": p.pp_virtual_stages,
                "recompute": t.recompute, "micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum}

    def overrides(self) -> str:
        """The settings that run this layout, as `key=value` separated by spaces."""
        keys = {"dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
                "ep": "parallel.ep", "zero": "parallel.zero", "sequence_parallel": "parallel.sequence_parallel",
                "pp_schedule": "parallel.pp_schedule", "pp_virtual_stages": "parallel.pp_virtual_stages",
                "recompute": "train.recompute", "micro_batch_size": "train.micro_batch_size",
                "grad_accum": "train.grad_accum"}
        out = []
        for key, value in self.layout().items():
            if value == "-":
                continue
            out.append(f"{keys[key]}={str(value).lower() if isinstance(value, bool) else value}")
        return " ".join(out)


@dataclass
class SearchResult:
    ranked: list[Candidate]  # best first
    meshes: int  # dp x tp x pp x cp (x ep) splits that pass validation
    costed: int  # layouts whose step time was predicted
    fitting: int  # layouts that fit the device memory
    seconds: float
    gpus: int
    global_batch_tokens: int


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(cfg: Config, gpus: int):
    m = cfg.model
    for tp in divisors(gpus):
        if m.num_heads % tp or m.num_kv_heads % tp:
            continue
        for cp in divisors(gpus // tp):
            for pp in divisors(gpus // (tp * cp)):
                if pp > m.num_layers:
                    continue
                dp = gpus // (tp * cp * pp)
                for ep in (divisors(dp) if m.num_experts else [1]):
                    if m.num_experts and m.num_experts % ep:
                        continue
                    yield dp, tp, pp, cp, ep


def _schedules(pp: int, layers: int):
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zero-bubble", 1)]
    return out + [("interleaved", v) for v in VIRTUAL_STAGES if pp * v <= layers]


def search_layouts(cfg: Config, profile: HardwareProfile, gpus: int, global_batch_tokens: int, top: int = 10,
                   fused: bool | None = None, device_memory: float | None = None,
                   only: dict | None = None, implemented_only: bool = True) -> SearchResult:
    """Rank the layouts of `cfg`'s model on `gpus` devices of `profile` for a global batch of
    `global_batch_tokens` (a multiple of train.seq_len). `only`: Candidate.layout() keys held fixed
    (e.g. a published run's stated dp, tp, pp; the search fills in the rest). `implemented_only`: rank only
    what `fivefold train` runs (fivefold.parallel.rules); False to model another framework's run."""
    only = only or {}
    start = time.perf_counter()
    seq = cfg.train.seq_len
    if global_batch_tokens % seq:
        raise ConfigError(f"--global-batch {global_batch_tokens} tokens is not a whole number of train.seq_len="
                          f"{seq} sequences; use a multiple of {seq}")
    sequences = global_batch_tokens // seq
    limit = device_memory or profile.memory_bytes
    found: list[Candidate] = []
    meshes = costed = fitting = 0
    for dp, tp, pp, cp, ep in _meshes(cfg, gpus):
        if sequences % dp or any(only.get(k, v) != v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp),
                                                                   ("ep", ep))):
            continue
        per_rank = sequences // dp
        base = copy.deepcopy(cfg)
        par = base.parallel
        par.dp, par.tp, par.pp, par.cp, par.ep = dp, tp, pp, cp, ep
        par.sequence_parallel = only.get("sequence_parallel", tp > 1)
        par.pp_layers, par.pp_schedule, par.pp_virtual_stages = "", "1f1b", 1
        base.train.micro_batch_size, base.train.grad_accum, base.train.batch_schedule = 1, per_rank, ""
        try:
            check_layout(base, implemented=implemented_only)
        except ConfigError:
            continue
        meshes += 1
        states = {(schedule, v, zero): _model_states(base, v, zero) for schedule, v in
                  _schedules(pp, cfg.model.num_layers) for zero in range(4)}
        for schedule, v in _schedules(pp, cfg.model.num_layers):
            if pp > 1 and any(only.get(k, x) != x for k, x in (("pp_schedule", schedule), ("pp_virtual_stages", v))):
                continue
            sizes = [only["micro_batch_size"]] if "micro_batch_size" in only else MICRO_BATCHES
            for mbs in (b for b in sizes if per_rank % b == 0):
                trial = copy.deepcopy(base)
                trial.parallel.pp_schedule, trial.parallel.pp_virtual_stages = schedule, v
                trial.train.micro_batch_size, trial.train.grad_accum = mbs, per_rank // mbs
                try:
                    check_layout(trial, implemented=implemented_only)
                except ConfigError:
                    continue
                fitted_any, best_zero = False, 4
                for recompute in [only["recompute"]] if "recompute" in only else RECOMPUTE:
                    trial.train.recompute = recompute
                    for zero in range(best_zero if dp * cp > 1 else min(best_zero, 1)):
                        if only.get("zero", zero) != zero or states[schedule, v, zero] > limit:
                            continue
                        trial.parallel.zero = zero
                        try:  # what train refuses is not ranked (e.g. ZeRO with a mixture of experts)
                            if implemented_only:
                                check_implemented(trial)
                        except ConfigError:
                            continue
                        memory = _most_loaded(trial, profile.device, limit)
                        if memory > limit:
                            continue
                        fitted_any, best_zero = True, zero
                        fitting += 1
                        floor = found[top - 1].speed.tokens_per_s_per_gpu if top and len(found) >= top else 0.0
                        speed = predict_step(trial, profile, fused, at_least=floor)
                        costed += 1
                        if speed is not None:
                            found.append(Candidate(copy.deepcopy(trial), speed, memory))
                            found.sort(key=lambda c: -c.speed.tokens_per_s_per_gpu)
                            del found[top or len(found):]
                        break
                    if best_zero == 0:
                        break
                if not fitted_any:
                    break  # a larger micro-batch needs more memory still
    return SearchResult(found, meshes, costed, fitting, time.perf_counter() - start,
                        gpus, global_batch_tokens)


def _model_states(cfg: Config, virtual_stages: int, zero: int) -> float:
    """Parameters + optimizer states of the larger of the first and last pipeline rank: a lower bound on
    its memory (fivefold.memory.plan counts them the same way) that needs no activation replay."""
    m, p = cfg.model, cfg.parallel
    bpp = formulas.bytes_per_param(cfg.train.precision, cfg.train.fp32_grad_accum)
    out = 0.0
    for stage in {0, p.pp - 1}:
        layers = formulas.rank_layers(m.num_layers, p.pp, stage, virtual_stages)
        n = sum(k for _, k in formulas.parameter_shapes(m, p.tp, layers, stage == 0, stage == p.pp - 1, p.ep))
        shard = math.ceil(n / p.dp)
        out = max(out, bpp.parameters * (shard if zero == 3 else n) + bpp.optimizer_states * (shard if zero else n))
    return out


def _most_loaded(cfg: Config, device: str, limit: float) -> float:
    return max(stage_total(cfg, s, device, limit) for s in {0, cfg.parallel.pp - 1})


def why_first(best: Candidate, second: Candidate) -> str:
    """What the winner gains over the runner-up, from their step-time breakdowns (GPU-microseconds per
    token, so layouts with different batches and device counts compare)."""
    a, b = best.speed, second.speed

    def per_token(speed, key: str) -> float:
        return speed.breakdown.get(key, 0.0) * speed.world / speed.tokens_per_step * 1e6

    diffs = {k: per_token(b, k) - per_token(a, k) for k in set(a.breakdown) | set(b.breakdown)}
    differ = ", ".join(f"{k}={v}" for k, v in best.layout().items() if second.layout()[k] != v) or "same layout"
    lead = a.tokens_per_s_per_gpu / b.tokens_per_s_per_gpu - 1
    if lead < 0.005:
        return f"#1 and #2 tie (within 0.5%): they differ in {differ}; either will do"
    gains = sorted(((v, k) for k, v in diffs.items() if v > 0), reverse=True)[:2]
    losses = sorted((v, k) for k, v in diffs.items() if v < 0)[:1]
    text = f"#1 is {100 * lead:.1f}% faster than #2 ({differ}): " + " and ".join(
        f"{v:.2f} us less {_NAMES[k]}" for v, k in gains) + " per token"
    if losses:
        v, k = losses[0]
        text += f", for {-v:.2f} us more {_NAMES[k]}"
    return text


_NAMES = {"compute": "compute", "recompute": "recomputation", "tp": "tensor-parallel communication",
          "cp": "ring-attention communication", "ep": "expert all-to-alls", "pp": "pipeline sends",
          "dp": "data-parallel communication", "bubble": "pipeline bubble", "optimizer": "the optimizer step",
          "slowest": "waiting on the slowest GPU", "host": "waiting on the host"}
