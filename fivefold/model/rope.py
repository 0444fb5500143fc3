"""Rotary position embeddings (Su et al. 2021), in the rotate-half layout used by Llama checkpoints."""

from __future__ import annotations

import math

import torch

from fivefold.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama-3 long-context scaling when configured."""
    d = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_scaling == "llama3":
        inv_freq = _llama3_scale(inv_freq, cfg)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than original_len/low_freq_factor are divided by `factor`,
    # shorter than original_len/high_freq_factor are kept, and the band between is interpolated.
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / lo, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - lo) / (hi - lo)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original / hi) & (wavelen <= original / lo)
    return torch.where(in_band, interpolated, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions (B, S) -> cos, sin of shape (B, 1, S, head_dim), computed in fp32 then cast."""
    angles = positions[..., None].float() * inv_freq  # (B, S, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, S, d)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, d): rotate each (x_i, x_{i+d/2}) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
