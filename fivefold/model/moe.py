"""Mixture of experts: a router picks the top-k of E SwiGLU experts for every token (Shazeer et al. 2017;
Mixtral's softmax over the k chosen logits), with an optional always-on shared expert.

Two auxiliary losses keep the router healthy, both attached to the module after each forward for the
trainer to add: Switch Transformer's load-balancing loss E * sum_e f_e P_e (f_e: fraction of routed
slots that chose expert e, P_e: mean router probability of e; Fedus et al. 2021) and ST-MoE's router
z-loss, the mean squared log-sum-exp of the logits (Zoph et al. 2022). With capacity_factor > 0 each
expert takes at most ceil(factor * tokens * k / E) tokens, in token order, and the rest of its
assignments are dropped (the token keeps its residual); 0 is dropless.

The experts' weights are stacked, (E, out, in) per projection, so that the tokens routed to all of
them, sorted by expert, go through each projection as one grouped matmul (`F.grouped_mm`: one kernel
for E jagged problems instead of E small ones, MegaBlocks' and torchtitan's approach); where the
device or dtype has no grouped matmul (float64, CUDA before sm80, shapes off its 16-byte alignment) or
`model.moe_grouped_mm=false`, a loop runs the same slices one expert at a time. Each expert's matrix
is initialised from its own name (`expert_matrix_name`), so the values do not depend on the stacking.

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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward rejects the
    broadcast (stride 0) gradients a reduction such as .sum() produces."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether F.grouped_mm runs these operands: bf16 on CUDA from sm80, fp32 / bf16 on the CPU (bf16 only
    inside torch.compile, whose shape function for it knows no other dtype), every row a multiple of 16
    bytes."""
    if x.dtype != weights[0].dtype or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    return grouped_mm_runs(x.device.type, x.dtype, {d for w in weights for d in w.shape[1:]})


def grouped_mm_runs(device_type: str, dtype: torch.dtype, widths) -> bool:
    """Whether F.grouped_mm takes experts of these `widths` (hidden and expert sizes) in `dtype` on a device of
    this type (a CUDA one from sm80): bf16 on CUDA, fp32 / bf16 on the CPU, rows a multiple of 16 bytes.
    fivefold.serve.step_memory asks it too: the experts' memory depends on which form runs."""
    if not hasattr(F, "grouped_mm"):
        return False
    if dtype not in ((torch.bfloat16,) if device_type == "cuda" else (torch.float32, torch.bfloat16)
                     if device_type == "cpu" else ()):
        return False
    return all(d * dtype.itemsize % 16 == 0 for d in widths)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def expert_matrix_name(name: str, expert: int) -> str:
    """The name expert `expert`'s matrix of the stacked parameter `name` ("...experts.gate_proj") is
    seeded from: what it would be called were each expert its own nn.Linear ("...experts.3.gate_proj.weight")."""
    prefix, _, proj = name.rpartition(".")
    return f"{prefix}.{expert}.{proj}.weight"


def is_stacked_expert(name: str) -> bool:
    return name.rsplit(".", 2)[-2:-1] == ["experts"]


class GroupedExperts(nn.Module):
    """E SwiGLU experts with their weights stacked: gate_proj, up_proj (E, f, h), down_proj (E, h, f).
    `forward(x, counts)`: x (A, h) holds the routed tokens sorted by expert, counts[e] of them for
    expert e; returns each row's expert output, same order."""

    def __init__(self, num_experts: int, hidden: int, width: int, grouped: bool = True):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.grouped = grouped
        # silu(gate) * up; fivefold.kernels swaps in its fused Triton kernel (train.kernels=triton).
        self.swiglu_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _swiglu
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default for each expert, for a layer built on its own (a model's materialisation
        gives every weight its seeded value instead)."""
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        if self.grouped and _grouped_mm_supported(x, *weights):
            ends = counts.cumsum(0).to(torch.int32)  # no host sync: the kernel reads the group ends on device

            def project(a, w):
                return _ContiguousGrad.apply(F.grouped_mm(a, w.transpose(-2, -1), offs=ends))
            return project(self.swiglu_fn(project(x, self.gate_proj), project(x, self.up_proj)), self.down_proj)
        # Every expert runs, an empty one on zero rows, so each weight takes part in backward.
        outputs = [F.linear(self.swiglu_fn(F.linear(rows, gate), F.linear(rows, up)), down)
                   for rows, gate, up, down in zip(x.split(counts.tolist()), *weights)]
        return torch.cat(outputs)


def expert_capacity(factor: float, tokens: int, k: int, num_experts: int) -> int:
    """Assignments one expert takes at most when `tokens` tokens are routed to k of `num_experts` each:
    ceil(factor * tokens * k / E); 0 (no limit) when factor <= 0, dropless."""
    return math.ceil(factor * tokens * k / num_experts) if factor > 0 else 0


def sorted_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order that groups the assignments by expert, token order kept within each; count per expert)."""
    return torch.argsort(expert_ids, stable=True), torch.bincount(expert_ids, minlength=num_experts)


class ExpertDispatch(Protocol):
    """Sends each routed (token, expert) assignment to its expert and returns the gate-weighted sum of
    the expert outputs per token: `tokens` (T, h); `expert_ids`, `token_ids`, `weights` (A,) for the A
    kept assignments; returns (T, h)."""

    def __call__(self, moe: "MoE", tokens: torch.Tensor, expert_ids: torch.Tensor, token_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor: ...


class LocalDispatch:
    """Every expert lives here: gather the routed tokens sorted by expert, run them, add them back."""

    def __call__(self, moe: "MoE", tokens, expert_ids, token_ids, weights):
        order, counts = sorted_by_expert(expert_ids, moe.num_experts)
        rows = token_ids[order]
        out = moe.experts(tokens[rows], counts) * weights[order, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, rows, out)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.k = cfg.num_experts, cfg.experts_per_token
        self.capacity_factor = cfg.capacity_factor
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_size, cfg.moe_grouped_mm)
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
        capacity = expert_capacity(self.capacity_factor, num_tokens, self.k, self.num_experts)
        one_hot = F.one_hot(expert_ids, self.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # arrival order at its expert, token order
        return position < capacity
