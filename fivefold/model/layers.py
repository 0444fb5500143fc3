"""Norms and feed-forward blocks of the Llama and GPT-2 families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019. Normalises in fp32 and casts back, as Llama does, so bf16 inputs stay stable."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.linear_bias)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); or the GPT-2 MLP: down(gelu(up(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        h, f, bias = cfg.hidden_size, cfg.ffn_hidden_size, cfg.linear_bias
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A seam: serving fuses the two products into one GEMM from outside (fivefold.serve.fused)."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_and_up(x)
            return self.down_proj(F.silu(gate) * up)
        # GPT-2 uses the tanh approximation of GELU ("gelu_new" in transformers).
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
