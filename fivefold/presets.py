"""Model presets as data: the real shapes of well-known checkpoints, plus tiny ones for tests/demos.

Parameter counts of the real presets are asserted in tests against the published model sizes.
"""

from __future__ import annotations

import dataclasses

from fivefold.config import ConfigError, ModelConfig

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=8192, norm_eps=1e-5, eos_token_id=128001)
_LLAMA31_SCALING = dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, max_seq_len=131072)

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(**_LLAMA3, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             ffn_hidden_size=14336),
    "llama3-70b": ModelConfig(**_LLAMA3, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              ffn_hidden_size=28672),
    "llama3.1-405b": ModelConfig(**{**_LLAMA3, **_LLAMA31_SCALING}, hidden_size=16384, num_layers=126,
                                 num_heads=128, num_kv_heads=8, ffn_hidden_size=53248),
    # Llama 3.2 1B: tied embeddings, RoPE scaled by 32 (the serving and single-GPU training benchmarks' model).
    "llama3.2-1b": ModelConfig(**{**_LLAMA3, **_LLAMA31_SCALING, "rope_scaling_factor": 32.0}, hidden_size=2048,
                               num_layers=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192, tie_embeddings=True),
    # Llama 3.2 3B: the same family at 3072 wide (the fp8 training benchmark's second shape).
    "llama3.2-3b": ModelConfig(**{**_LLAMA3, **_LLAMA31_SCALING, "rope_scaling_factor": 32.0}, hidden_size=3072,
                               num_layers=28, num_heads=24, num_kv_heads=8, ffn_hidden_size=8192, tie_embeddings=True),
    "llama2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                             ffn_hidden_size=11008, max_seq_len=4096, eos_token_id=2),
    "mistral-7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              ffn_hidden_size=14336, max_seq_len=32768, eos_token_id=2),
    # Mixtral 8x7B: Mistral 7B's attention, 8 SwiGLU experts of 14336, top-2 (46.7B total, 12.9B active).
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                ffn_hidden_size=14336, rope_theta=1e6, max_seq_len=32768, num_experts=8,
                                experts_per_token=2, eos_token_id=2),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                ffn_hidden_size=4864, tie_embeddings=True, qkv_bias=True, rope_theta=1000000.0,
                                norm_eps=1e-6, max_seq_len=32768, eos_token_id=151643),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                ffn_hidden_size=1536, tie_embeddings=True, rope_theta=100000.0, max_seq_len=8192,
                                eos_token_id=0),
    "gpt2-xl": ModelConfig(vocab_size=50257, hidden_size=1600, num_layers=48, num_heads=25, num_kv_heads=25,
                           ffn_hidden_size=6400, norm="layernorm", activation="gelu", position="learned",
                           max_seq_len=1024, tie_embeddings=True, linear_bias=True, eos_token_id=50256),
    # The default demo model: trains in a few minutes on 2 CPU cores (≈5M parameters).
    "demo": ModelConfig(),
    # ≈34M parameters: the benchmark model (bench/train_throughput.py).
    "bench-30m": ModelConfig(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                             ffn_hidden_size=1536),
    # Tiny models for tests.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=128),
    "tiny-moe": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=128, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=64),
    "tiny-gpt2": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                             ffn_hidden_size=256, norm="layernorm", activation="gelu", position="learned",
                             max_seq_len=256, tie_embeddings=True, linear_bias=True),
}

# Published parameter counts (Hugging Face model cards / `sum(p.numel())` of the released checkpoints).
REAL_PARAM_COUNTS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,
    "smollm2-135m": 134_515_008,
    "gpt2-xl": 1_557_611_200,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
