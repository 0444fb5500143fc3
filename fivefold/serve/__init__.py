"""Serving: a paged KV cache, continuous batching with a prefix cache, and an OpenAI-compatible server."""

from fivefold.serve.engine import Engine, RequestError, RequestOutput
from fivefold.serve.llm import LLM
from fivefold.serve.loading import load_model_for_serving
from fivefold.serve.sampling import SamplingParams

__all__ = ["LLM", "Engine", "RequestError", "RequestOutput", "SamplingParams", "load_model_for_serving"]
