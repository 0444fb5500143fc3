"""Activation recomputation applied from outside the model (the model itself knows nothing of it).

none       keep every activation autograd saves.
selective  recompute only the attention core softmax(q k^T) v of each block: with eager attention this
           drops the O(s^2) scores and probabilities, the cheapest-to-recompute, largest activations
           (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", 4.2).
full       keep only each block's input and recompute the whole block during backward (Chen et al. 2016).

Wrapping replaces the module instance's `forward` rather than inserting a wrapper module, so parameter
names (and therefore checkpoints and the name-seeded init) are unchanged.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.model import Transformer


def recompute_module(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        # Non-reentrant checkpointing: works with kwargs, tensors that need no grad and torch.compile.
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: Transformer, mode: str) -> None:
    if mode == "none":
        return
    for block in model.layers:
        if hasattr(block, "attn"):  # a pipeline stage holds placeholders for other stages' blocks
            recompute_module(block if mode == "full" else block.attn.core)
