"""Mixture of experts: a router picks the top-k of E SwiGLU experts for every token (Shazeer et al. 2017;
Mixtral's softmax over the k chosen logits), with an optional always-on shared expert.

Two auxiliary losses keep the router healthy, both attached to the module after each forward for the
trainer to add: Switch Transformer's load-balancing loss E * sum_e f_e P_e (f_e: fraction of routed
slots that chose expert e, P_e: mean router probability of e; Fedus et al. 2021) and ST-MoE's router
z-loss, the mean squared log-sum-exp of the logits (Zoph et al. 2022). With capacity_factor > 0 each
expert takes at most ceil(factor * tokens * k / E) tokens, in token order, and the rest of its
assignments are dropped (the token keeps its residual); 0 is dropless.

How routed tokens reach their experts is an ExpertDispatch's business: locally by default, or through
all-to-all when experts are spread over ranks (fivefold.parallel.expert_parallel); `parallelize`
chooses, through `MoE.distribute`, the one declared place where a runtime changes this module.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.model.layers import MLP


def expert_config(cfg: ModelConfig, hidden: int) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, ffn_hidden_size=hidden, linear_bias=False)


class ExpertDispatch(Protocol):
    """Sends each routed (token, expert) assignment to its expert and returns the gate-weighted sum of
    the expert outputs per token: `tokens` (T, h); `expert_ids`, `token_ids`, `weights` (A,) for the A
    kept assignments; returns (T, h)."""

    def __call__(self, moe: "MoE", tokens: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor: ...


class LocalDispatch:
    """Every expert lives here: run each on the tokens routed to it."""

    def __call__(self, moe: "MoE", tokens, expert_ids, token_ids, weights):
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(moe.experts):
            mine = expert_ids == e
            if mine.any():
                rows = token_ids[mine]
                out.index_add_(0, rows, expert(tokens[rows]) * weights[mine, None].to(tokens.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.k = cfg.num_experts, cfg.experts_per_token
        self.capacity_factor = cfg.capacity_factor
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(expert_config(cfg, cfg.expert_size)) for _ in range(cfg.num_experts))
        self.shared_expert = MLP(expert_config(cfg, cfg.shared_expert_size)) if cfg.shared_expert_size else None
        self.dispatch: ExpertDispatch = LocalDispatch()
        # Sums a routing statistic over the ranks holding other tokens of the same sequences (context
        # parallelism), so the router losses are the whole micro-batch's; one process holds them all.
        self.sum_over_sequence: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def distribute(self, dispatch: ExpertDispatch | None = None,
                   sum_over_sequence: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """How a parallel runtime runs this layer: its experts' dispatch, and the sum of routing
        statistics over the ranks that hold the rest of each sequence."""
        self.dispatch = dispatch or self.dispatch
        self.sum_over_sequence = sum_over_sequence or self.sum_over_sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens).float()  # (T, E): routing decisions in fp32
        top_logits, top_experts = logits.topk(self.k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)  # over the chosen k (Mixtral)
        expert_ids, weights = top_experts.flatten(), weights.flatten()
        token_ids = torch.arange(len(tokens), device=x.device).repeat_interleave(self.k)
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        keep = self._within_capacity(expert_ids, len(tokens))
        out = self.dispatch(self, tokens, expert_ids[keep], token_ids[keep], weights[keep])
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        probs = torch.softmax(logits, dim=-1)
        # Means over the micro-batch's tokens, as sums over this rank's divided by the whole count.
        all_counts = self.sum_over_sequence(torch.cat([counts.float(), counts.new_tensor([len(tokens)]).float()]))
        num_tokens = all_counts[-1]
        routed_fraction = all_counts[:-1] / (num_tokens * self.k)
        balance = self.num_experts * (routed_fraction * probs.sum(0) / num_tokens).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().sum() / num_tokens
        self.aux_loss = self.aux_coef * balance + self.z_coef * z_loss
        self.stats = {"tokens_per_expert": counts.detach(), "dropped": (~keep).sum().detach(),
                      "assignments": torch.tensor(len(expert_ids))}
        return out.view(shape)

    def _within_capacity(self, expert_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.capacity_factor <= 0:
            return torch.ones_like(expert_ids, dtype=torch.bool)
        capacity = math.ceil(self.capacity_factor * num_tokens * self.k / self.num_experts)
        one_hot = F.one_hot(expert_ids, self.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # arrival order at its expert, token order
        return position < capacity
