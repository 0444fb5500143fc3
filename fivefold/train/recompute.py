"""Activation recomputation applied from outside the model (the model itself knows nothing of it).

none       keep every activation autograd saves.
selective  recompute only the attention core softmax(q k^T) v of each block: with eager attention this
           drops the O(s^2) scores and probabilities, the cheapest-to-recompute, largest activations
           (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", 4.2).
full       keep only each block's input and recompute the whole block during backward (Chen et al. 2016).
ops        op-level selective (torchtitan's default policy): each block is checkpointed like `full`, but it
           keeps the outputs of every other matmul and of the fused attention kernel, so backward recomputes
           the memory-bound work (norms, RoPE, activations, residuals) and half the matmuls, not the
           attention. Between selective and full in both memory and compute.

train.recompute_layers limits either mode to some layers ("every:k", or a list): the others keep their
activations. Each fully recomputed block gives back its activations but its input, for one more forward
of it, so memory and compute move along a line between none and full (`fivefold plan --sweep recompute`
draws it, with the sqrt(n) point of Chen et al.'s analysis marked).

Wrapping replaces the module instance's `forward` rather than inserting a wrapper module, so parameter
names (and therefore checkpoints and the name-seeded init) are unchanged.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fivefold.config_checks import recompute_layer_set
from fivefold.model import Transformer


def _aten(*names: str) -> frozenset:
    """The default overloads of these aten ops that this torch build has."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# What train.recompute=ops keeps: matmul outputs (every other one, counted in the order the block runs
# them) and the fused attention kernels' outputs (output and log-sum-exp), whatever the backend.
MATMULS = _aten("mm", "addmm", "_grouped_mm", "_scaled_mm")
ATTENTION = _aten("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _ops_policy():
    """One checkpoint call's policy. The forward's decisions are what count (the recomputation takes each
    kept output back from the cache); the matmuls are counted per pass all the same."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if func in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# Checkpointed regions whose forward is running now. Set around the checkpoint call, not inside it:
# torch.compile's checkpoint operator allows no side effects in its body, so the recomputation does not
# see it. Read it only for what leaves a region's ops unchanged: the ops policy replays the cache by
# matching the recomputation's ops to the forward's, one by one.
_REGIONS = [0]


def checkpointed() -> bool:
    """Whether a checkpointed region's forward is running: autograd keeps none of its tensors (but what
    the ops policy keeps), so code that would release a saved tensor early has nothing to release."""
    return _REGIONS[0] > 0


def recompute_module(module: nn.Module, keep_ops: bool = False) -> None:
    """Checkpoint `module`'s forward; `keep_ops`: with train.recompute=ops's selective policy."""
    # The class's forward and a weak reference: a closure holding the bound method, stored on the module,
    # would be a reference cycle keeping a dropped model's tensors until the cycle collector runs.
    inner, ref = type(module).forward, weakref.ref(module)
    extra = {"context_fn": _ops_policy} if keep_ops else {}

    def forward(*args, **kwargs):
        _REGIONS[0] += 1
        try:
            # Non-reentrant checkpointing: works with kwargs, tensors that need no grad and torch.compile.
            return checkpoint(inner, ref(), *args, use_reentrant=False, **extra, **kwargs)
        finally:
            _REGIONS[0] -= 1

    module.forward = forward


def compile_module(module: nn.Module) -> None:
    """torch.compile `module`'s forward (its recomputing wrapper, if any), holding the module weakly:
    nn.Module.compile() stores the compiled bound method on the module, a reference cycle. The module's
    hooks stay outside the graph and run eagerly around it: ZeRO-3's gather / free and sequence
    parallelism's release / re-gather change parameter and input storage in place, which a compiled
    graph must see as fresh inputs. Modules of one class and shape share the compiled graph: their
    parameters are its inputs."""
    if "forward" in vars(module):  # recompute_module's wrapper, which holds the module weakly already
        module.forward = torch.compile(module.forward)
        return
    compiled, ref = torch.compile(type(module).forward), weakref.ref(module)
    module.forward = lambda *args, **kwargs: compiled(ref(), *args, **kwargs)


def apply_recompute(model: Transformer, mode: str, layers: str = "") -> None:
    """Recompute `mode` in the blocks that train.recompute_layers `layers` names (default: all)."""
    if mode == "none":
        return
    chosen = recompute_layer_set(layers, len(model.layers), mode)
    for i, block in enumerate(model.layers):
        if hasattr(block, "attn") and i in chosen:  # a pipeline stage holds placeholders for other stages' blocks
            recompute_module(block.attn.core if mode == "selective" else block, keep_ops=mode == "ops")
            if mode == "ops":  # the matmul outputs it keeps must not be summed in place (tensor parallelism)
                for module in block.modules():
                    if hasattr(module, "copy_partial"):
                        module.copy_partial = True
