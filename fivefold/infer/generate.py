"""Autoregressive generation: one prefill pass over the prompt, then one cached decode step per token."""

from __future__ import annotations

import torch

from fivefold.infer.sampling import sample_next
from fivefold.model import ForwardContext, KVCache, Transformer


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """Returns the generated continuation (without the prompt), stopping early at `eos_id`."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    cfg = model.cfg
    device = next(model.parameters()).device
    capacity = len(prompt_ids) + max_new_tokens
    if cfg.position == "learned" and capacity > cfg.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {capacity} exceeds model.max_seq_len={cfg.max_seq_len}")
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg, batch=1, capacity=capacity, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    tokens = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, ForwardContext(kv_cache=cache))[:, -1]  # (1, V): only the last position is needed
        next_id = sample_next(logits, temperature, top_k, top_p, generator)
        token = int(next_id.item())
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        tokens = next_id[:, None]
    model.train(was_training)
    return out
