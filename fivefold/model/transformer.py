"""A decoder-only transformer covering the Llama family (and GPT-2) by config.

Plain PyTorch: nothing here knows about parallelism, recomputation or precision policy; those are
applied from outside (fivefold/train, fivefold/parallel). Parameter names follow Hugging Face's
Llama layout so that checkpoints map one-to-one.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import ModelConfig
from fivefold.model.attention import Attention
from fivefold.model.context import ForwardContext
from fivefold.model.layers import MLP, make_norm
from fivefold.model.moe import MoE
from fivefold.model.rope import rope_cos_sin, rope_inv_freq


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, rope, mask, kv_cache=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.position == "learned":
            self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        if cfg.position == "rope":
            self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head (again after to_empty(), which unties them)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self, device=None) -> None:
        """Recompute non-persistent buffers in fp32, on `device` (default: where they are), e.g. after
        materialising from the meta device or casting the parameters."""
        if self.cfg.position == "rope":
            self.rope_inv_freq = rope_inv_freq(self.cfg).to(device or self.rope_inv_freq.device)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """input_ids (B, S) -> logits (B, S, V), or (N, V) at `ctx.logits_at`; `ctx` (ForwardContext):
        positions, documents, KV cache."""
        ctx = ctx or ForwardContext()
        positions = self.positions(input_ids, ctx)
        x = self.embed(input_ids, positions)
        rope, mask = self.context(input_ids, positions, ctx, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, mask, ctx.kv_cache)
        if ctx.logits_at is not None:
            x = x.reshape(-1, x.shape[-1])[ctx.logits_at]  # (N, h) -> logits (N, V)
        return self.head(x)

    # The pieces of forward, so that a pipeline stage can run only its own (fivefold.parallel.pipeline).
    @staticmethod
    def positions(input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.positions is not None:
            return ctx.positions
        b, s = input_ids.shape
        return torch.arange(s, device=input_ids.device).expand(b, s)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, S, h)
        if self.cfg.position == "learned":
            x = x + self.embed_positions(positions)
        return x

    def context(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, dtype: torch.dtype):
        """What every block needs besides its input: RoPE's (cos, sin) in `dtype` and the attention mask
        (the context's own, or the causal / document mask of this call's tokens)."""
        rope = rope_cos_sin(self.rope_inv_freq, positions, dtype) if self.cfg.position == "rope" else None
        if ctx.mask is not None:
            return rope, ctx.mask
        return rope, attention_mask(input_ids.shape[1], ctx.doc_ids, input_ids.device)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def attention_mask(s: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor | None:
    """None when plain causal attention suffices (lets SDPA pick flash); otherwise a boolean (B, 1, S, S)
    mask, True where attention is allowed: causal and within the same packed document."""
    if doc_ids is None:
        return None
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, S, S)
    return (causal & same_doc)[:, None]


def doc_ids_from_tokens(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Document index per token of packed sequences: a new document starts after each eos token."""
    is_eos = (input_ids == eos_token_id).long()
    return torch.cumsum(is_eos, dim=1) - is_eos
