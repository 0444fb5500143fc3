"""Causal self-attention with grouped-query heads, via SDPA or an explicit (eager) implementation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.model.rope import apply_rope


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v. A module of its own so that selective recomputation
    (Korthikanti et al. 2022, section 4) can recompute exactly this part from outside."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.impl = cfg.attention
        self.groups = cfg.num_heads // cfg.num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        # q (B, H, Sq, d); k, v (B, Hkv, Sk, d); mask: None = causal over equal lengths,
        # otherwise a boolean (B or 1, 1, Sq, Sk) tensor where True means "may attend".
        if q.shape[2] == 1 and self.groups > 1 and mask is not None:
            # One query token (a decode step): the heads that share a key/value head become that head's query
            # rows. Same arithmetic, but each key and value is read once per group rather than once per head,
            # and the CPU's flash kernel, which works a block of query rows at a time, gets `groups` rows
            # instead of one: on a 2-core CPU, the calls of bench/serve.py's default workload (smollm2-135m's
            # 9/3 heads) 1.31x faster with cold caches (bench/serve_decode_attention.py), 2-3x with warm ones.
            b, h, _, d = q.shape
            rows = q.reshape(b, k.shape[1], self.groups, d)
            return self.attend(rows, k, v, mask, groups=1).reshape(b, h, 1, d)
        return self.attend(q, k, v, mask, self.groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               groups: int) -> torch.Tensor:
        if self.impl == "sdpa":
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, Sq, Sk): the s^2 term
        if mask is None:
            sq, sk = scores.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return probs @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        self.use_rope = cfg.position == "rope"
        self.rope_fn = apply_rope  # a seam: fivefold.kernels swaps in a fused kernel from outside
        qkv_bias = cfg.qkv_bias or cfg.linear_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.linear_bias)
        self.core = AttentionCore(cfg)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A seam: serving fuses the three products into one GEMM from outside (fivefold.serve.fused)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, kv_cache=None) -> torch.Tensor:
        q, k, v = self.project(x)
        # Heads and length from the projections, not the config or x: a sharded projection may return
        # fewer heads, or a longer (gathered) sequence.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, H, S, d)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, d)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            q, k = self.rope_fn(q, *rope), self.rope_fn(k, *rope)
        if kv_cache is None:
            out = self.core(q, k, v, mask)  # (B, H, S, d)
        else:  # the cache stores this call's keys and values, then runs the core over what it holds
            out = kv_cache.attend(self.layer_idx, q, k, v, self.core, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
