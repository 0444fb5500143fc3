"""Plain-PyTorch Llama-family model. Imports nothing from parallel or training code."""

from fivefold.model.context import ForwardContext
from fivefold.model.init import build_model, initial_expert_matrix, initial_value, materialise, materialise_parameters, meta_model
from fivefold.model.transformer import Block, Transformer, attention_mask, doc_ids_from_tokens

__all__ = ["Transformer", "Block", "build_model", "meta_model", "materialise", "materialise_parameters",
           "initial_value", "initial_expert_matrix", "ForwardContext", "attention_mask", "doc_ids_from_tokens"]
