"""AdamW over fp32 master weights, and the learning-rate and batch-size schedules.

Under bf16-mixed the model's parameters are bf16 (that is what forward and backward touch), and this
optimizer keeps the fp32 master copies and fp32 Adam moments: 2 + 2 + 12 bytes per parameter, the
ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1). With fp32 gradient accumulation each
bf16 gradient is folded into a persistent fp32 buffer as soon as autograd produces it (+4 bytes).
Under fp32 the masters *are* the parameters and nothing is copied.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.config import TrainConfig, parse_batch_schedule
from fivefold.memory.formulas import step_chunk_key


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm gains, biases and embeddings are not decayed (they are not 'weights' that decay should shrink)."""
    return param.ndim < 2 or "embed" in name or "norm" in name


class MasterWeightAdamW:
    def __init__(self, model: nn.Module, cfg: TrainConfig, masters: list[torch.Tensor] | None = None):
        """`masters`: the fp32 values of the (bf16) parameters, taken before they were rounded to bf16;
        without them the masters start from the rounded values."""
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.mixed = cfg.precision == "bf16-mixed"
        if self.mixed:
            self.masters = masters if masters is not None else [p.detach().float().clone() for p in self.params]
        else:
            self.masters = list(self.params)
        self.main_grads = None
        if cfg.fp32_grad_accum:
            self.main_grads = [torch.zeros_like(m) for m in self.masters]
            for p, buf in zip(self.params, self.main_grads):
                p.register_post_accumulate_grad_hook(_accumulate_into(buf))
        decay = [m for n, p, m in zip(self.names, self.params, self.masters) if not no_decay(n, p)]
        rest = [m for n, p, m in zip(self.names, self.params, self.masters) if no_decay(n, p)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.chunks = step_chunks(self.names)
        impl = {"fused": True} if cfg.optimizer_impl == "fused" else {"foreach": True}
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)

    @torch.no_grad()
    def step(self, lr: float, grad_clip: float) -> torch.Tensor:
        """Clip by the global norm, then update chunk by chunk (embeddings, each block, the head).

        Stepping one chunk at a time bounds the step's temporaries (the fp32 copy of bf16 gradients,
        foreach AdamW's sqrt(exp_avg_sq)) by the largest chunk instead of the whole model, and frees each
        chunk's gradients as soon as it is updated. Returns the pre-clip gradient norm."""
        if self.main_grads is not None:
            grads = list(self.main_grads)
        else:
            grads = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None  # from here on `grads` holds the only reference, released chunk by chunk
        present = [g for g in grads if g is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(present, 2, dtype=torch.float32)))
        coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0) if grad_clip > 0 else None
        for group in self.inner.param_groups:
            group["lr"] = lr
        for chunk in self.chunks:
            masters = [self.masters[i] for i in chunk if grads[i] is not None]
            for i in chunk:
                if grads[i] is not None:
                    self.masters[i].grad = grads[i].float() if grads[i].dtype != torch.float32 else grads[i]
                    grads[i] = None
            if coef is not None:
                torch._foreach_mul_([m.grad for m in masters], coef)
            self.inner.step()  # AdamW skips parameters without a gradient: only this chunk moves
            if self.mixed:
                torch._foreach_copy_([self.params[i] for i in chunk if self.masters[i].grad is not None],
                                     masters)
            for m in masters:
                m.grad = None
        return norm

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None
        if self.main_grads is not None:
            for g in self.main_grads:
                g.zero_()

    # -- checkpointing: flat name -> tensor maps (safetensors-friendly, no pickle) -------------------
    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in zip(self.names, self.masters)}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, m in zip(self.names, self.masters):
            for key, value in self.inner.state.get(m, {}).items():
                out[f"{name}/{key}"] = value.detach().reshape(-1) if value.ndim == 0 else value.detach()
        return out

    @torch.no_grad()
    def load(self, masters: dict[str, torch.Tensor], states: dict[str, torch.Tensor]) -> None:
        for name, p, m in zip(self.names, self.params, self.masters):
            m.copy_(masters[name])
            if self.mixed:
                p.copy_(m)
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                value = states.get(f"{name}/{key}")
                if value is not None:
                    state[key] = value.reshape(()) if key == "step" else value.to(m.device).clone()
            if state:
                self.inner.state[m] = state


def step_chunks(names: list[str]) -> list[list[int]]:
    """Indices of parameters grouped by the unit they are stepped with (one block, or a top-level module)."""
    chunks: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        chunks.setdefault(step_chunk_key(name), []).append(i)
    return list(chunks.values())


def _accumulate_into(buffer: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        buffer.add_(param.grad)  # bf16 -> fp32 add: accumulation across micro-batches happens in fp32
        param.grad = None
    return hook


# ---------------------------------------------------------------------------------------------------
# Schedules


def lr_at(step: int, cfg: TrainConfig, batch_tokens: int, base_batch_tokens: int) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup, then the decay shape, times the
    batch-size scaling rule (linear: Goyal et al. 2017; square root: Krizhevsky 2014, Malladi et al. 2022)."""
    peak = cfg.lr * _batch_scale(cfg.lr_scaling, batch_tokens, base_batch_tokens)
    floor = peak * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    total = max(cfg.steps, cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return peak
    if cfg.lr_schedule == "wsd":  # warmup-stable-decay (Hu et al. 2024, MiniCPM): flat, then linear decay
        decay_start = max(cfg.warmup_steps, int(total * (1 - cfg.decay_fraction)))
        if step < decay_start:
            return peak
        frac = (step - decay_start) / max(1, total - decay_start)
        return peak - (peak - floor) * min(1.0, frac)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return peak - (peak - floor) * frac
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def _batch_scale(rule: str, batch_tokens: int, base_tokens: int) -> float:
    ratio = batch_tokens / base_tokens
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def grad_accum_at(tokens_seen: int, cfg: TrainConfig) -> int:
    """Gradient-accumulation steps in force after `tokens_seen` tokens (the batch-size schedule)."""
    accum = cfg.grad_accum
    for threshold, value in parse_batch_schedule(cfg.batch_schedule):
        if tokens_seen >= threshold:
            accum = value
    return accum

