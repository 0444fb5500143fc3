"""Inference: sampling and generation with a KV cache."""
