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

from fivefold.config import ConfigError, TrainConfig, parse_batch_schedule


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm gains, biases and embeddings are not decayed (they are not 'weights' that decay should shrink)."""
    return param.ndim < 2 or "embed" in name or "norm" in name


class MasterWeightAdamW:
    def __init__(self, model: nn.Module, cfg: TrainConfig):
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.mixed = cfg.precision == "bf16-mixed"
        if self.mixed:
            self.masters = [p.detach().float().clone() for p in self.params]
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
        impl = {"fused": True} if cfg.optimizer_impl == "fused" else {"foreach": True}
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)

    @torch.no_grad()
    def step(self, lr: float, grad_clip: float) -> torch.Tensor:
        """Move gradients onto the masters, clip, update, copy masters back; returns the pre-clip grad norm."""
        if self.main_grads is not None:
            for m, g in zip(self.masters, self.main_grads):
                m.grad = g
        elif self.mixed:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.masters, grad_clip, norm, foreach=True)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.mixed:
            torch._foreach_copy_(list(self.params), self.masters)
        return norm

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad = None
        if self.main_grads is not None:
            for m, g in zip(self.masters, self.main_grads):
                m.grad = None
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


def check_optimizer_impl(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.optimizer_impl == "fused" and device.type not in ("cuda", "cpu"):
        raise ConfigError(f"train.optimizer_impl=fused is not available on {device.type}; use foreach")
