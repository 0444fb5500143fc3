"""A preallocated key/value cache for incremental decoding (one sequence batch, fixed capacity)."""

from __future__ import annotations

import torch

from fivefold.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, device, dtype: torch.dtype):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0  # tokens cached before the current forward pass

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, Hkv, S_new, d) for `layer`; return all cached keys and values so far."""
        s_new = k.shape[2]
        end = self.length + s_new
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end} tokens)")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, mask) -> torch.Tensor:
        """The attention of one layer's queries over every cached key, this call's included."""
        k, v = self.update(layer, k, v)
        return core(q, k, v, mask)

    def advance(self, tokens: int) -> None:
        """The tokens of the forward pass that just ran become part of the cache."""
        self.length += tokens
