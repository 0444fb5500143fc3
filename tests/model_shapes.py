"""Model shapes shared by tests: random valid configs of both families."""

import random

from fivefold.config import ModelConfig


def random_model_config(rng: random.Random) -> ModelConfig:
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3])
    gpt2 = rng.random() < 0.3
    return ModelConfig(
        vocab_size=rng.randint(50, 500), hidden_size=heads * rng.choice([8, 16]), num_layers=rng.randint(1, 4),
        num_heads=heads, num_kv_heads=heads if gpt2 else kv, ffn_hidden_size=rng.randint(16, 200),
        norm="layernorm" if gpt2 else "rmsnorm", activation="gelu" if gpt2 else "swiglu",
        position="learned" if gpt2 else "rope", max_seq_len=rng.randint(16, 64), head_dim=rng.choice([0, 0, 12]),
        tie_embeddings=rng.random() < 0.5, qkv_bias=rng.random() < 0.3, linear_bias=gpt2 and rng.random() < 0.7)
