"""Parameter and FLOP counts as pure functions of the model config.

The same config objects build the model, so tests assert these equal the built model's counts.
"""

from __future__ import annotations

from fivefold.config import ModelConfig


def norm_params(cfg: ModelConfig) -> int:
    has_bias = cfg.norm == "layernorm" and cfg.linear_bias
    return cfg.hidden_size * (2 if has_bias else 1)


def attention_params(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    weights = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
    qkv_bias = (cfg.q_size + 2 * cfg.kv_size) if (cfg.qkv_bias or cfg.linear_bias) else 0
    out_bias = h if cfg.linear_bias else 0
    return weights + qkv_bias + out_bias


def mlp_params(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    matrices = 3 if cfg.activation == "swiglu" else 2
    bias = ((matrices - 1) * f + h) if cfg.linear_bias else 0
    return matrices * h * f + bias


def layer_params(cfg: ModelConfig) -> int:
    return attention_params(cfg) + mlp_params(cfg) + 2 * norm_params(cfg)


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, learned positions and the (untied) LM head."""
    tokens = cfg.vocab_size * cfg.hidden_size
    positions = cfg.max_seq_len * cfg.hidden_size if cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return tokens + positions + head


def count_params(cfg: ModelConfig) -> int:
    return embedding_params(cfg) + cfg.num_layers * layer_params(cfg) + norm_params(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's linears plus the LM head
    (input embeddings and norms are lookups / elementwise)."""
    per_layer = attention_params(cfg) + mlp_params(cfg)
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: 2 per matmul parameter forward (x3 for forward + backward), plus the
    attention scores and weighted sum: 2 * 2 * s * q_size per layer forward for full (non-causal)
    attention, as in the PaLM paper's MFU definition (Chowdhery et al. 2022, appendix B), which
    counts the causal half as done."""
    forward = 2 * matmul_params(cfg) + 4 * cfg.num_layers * seq_len * cfg.q_size
    return 3 * forward if training else forward
