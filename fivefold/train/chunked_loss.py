"""The LM head and the cross-entropy fused over token chunks: the (tokens x vocabulary) logits never exist.

At Llama-3's 128k vocabulary the logits (and their fp32 copy and log-probabilities) are the largest
activations of a step, and nothing needs them but the loss. With `train.loss_chunk = c` the model's LM
head becomes `FeatureHead`, which hands the final normed hidden states through unchanged; the loss then
multiplies c tokens at a time by the head's weight, keeps only each token's log-sum-exp (4 bytes), and in
backward makes each chunk's logits again to turn them into the input and weight gradients. Forward holds
one chunk's logits, backward one chunk's logits and gradient: c x V instead of N x V. The price is the
head's matmul once more in backward (one third more head FLOPs).

Under tensor parallelism the weight is split by vocabulary rows as the column-parallel head is: each
rank makes its chunk's logit columns, and the max, the softmax denominator and the target logit are
all-reduced over N numbers per chunk (as the vocabulary-parallel cross-entropy does). The input's
tensor-parallel entrance is done here, not by hooks: replicated, its gradient is all-reduced; split along
the sequence (SP), it is all-gathered in forward and again in backward, so only this rank's part is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.collectives import gather_sequence, reduce_scatter_sequence


class FeatureHead(nn.Module):
    """Stands in for the LM head (same `weight`, so names, placements and ties are unchanged): returns
    its input, the final normed hidden states, for `chunked_cross_entropy` to apply the weight to."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.weight = head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def use_feature_head(model: nn.Module) -> None:
    """Swap the model's LM head for a FeatureHead (on the meta device, before tensor parallelism)."""
    model.lm_head = FeatureHead(model.lm_head)


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                          ignore_index: int = -100, group=None, vocab_start: int = 0,
                          sequence_parallel: bool = False) -> torch.Tensor:
    """Summed cross-entropy (fp32) of the logits x @ weight.T against `labels`, skipping ignore_index,
    made `chunk` tokens at a time. x (B, S, h), or this rank's (B, S / tp, h) under sequence parallelism;
    labels (B, S); weight (V, h), or this rank's vocabulary rows from `vocab_start` under `group`."""
    return _ChunkedCrossEntropy.apply(x, weight, labels, chunk, ignore_index, group, vocab_start,
                                      sequence_parallel)


def _whole(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The (B, S, h) input every rank of the group multiplies: gathered along the sequence under SP."""
    return gather_sequence(x, group) if sequence_parallel and group is not None else x


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk, ignore_index, group, vocab_start, sequence_parallel):
        whole = _whole(x, group, sequence_parallel)
        flat, labels = whole.reshape(-1, whole.shape[-1]), labels.reshape(-1)
        keep = labels != ignore_index
        local = labels - vocab_start
        mine = (local >= 0) & (local < weight.shape[0]) & keep
        lse = torch.empty(len(flat), dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, len(flat), chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(flat[rows], weight).float()  # as the plain head: compute dtype, then fp32
            lse[rows] = _log_sum_exp(logits, group)
            target = _target_logit(logits, local[rows], mine[rows], group)
            del logits
            total += torch.where(keep[rows], lse[rows] - target, 0.0).sum()
        ctx.save_for_backward(x if sequence_parallel and group is not None else flat, weight, local, mine, keep,
                              lse)
        ctx.shape, ctx.chunk, ctx.group, ctx.sp = x.shape, chunk, group, sequence_parallel
        return total

    @staticmethod
    def backward(ctx, grad):
        saved, weight, local, mine, keep, lse = ctx.saved_tensors
        group, sp = ctx.group, ctx.sp and ctx.group is not None
        flat = _whole(saved, group, True).flatten(0, 1) if sp else saved
        grad_x = torch.empty_like(flat)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad.float() * keep
        for start in range(0, len(flat), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            # d loss / d logits = softmax - one-hot of the target, per kept token, times the output's gradient
            probs = F.linear(flat[rows], weight).float().sub_(lse[rows, None]).exp_()
            # 1 off each kept target this rank holds, 0 off one logit of every other row (x - 0 == x): no nonzero(),
            # whose size the host would wait for in the middle of the backward
            target = local[rows].clamp(0, probs.shape[1] - 1)
            row = torch.arange(len(target), device=probs.device)
            probs[row, target] -= mine[rows].to(probs.dtype)
            probs *= scale[rows, None]
            g = probs.to(flat.dtype)
            del probs
            torch.mm(g, weight, out=grad_x[rows])
            if grad_w is not None:
                grad_w.addmm_(g.t(), flat[rows])
            del g  # before the next chunk's logits: one chunk at a time
        grad_x = grad_x.view(*ctx.shape[:1], -1, ctx.shape[-1])
        if sp:
            grad_x = reduce_scatter_sequence(grad_x, group)
        elif group is not None:  # every rank's input was the same tensor: its gradient is the sum
            dist.all_reduce(grad_x, group=group)
        return grad_x.view(ctx.shape), grad_w, None, None, None, None, None, None


def _log_sum_exp(logits: torch.Tensor, group) -> torch.Tensor:
    """Per-row log-sum-exp of (n, V) logits, or of (n, V / tp) vocabulary shards over `group`."""
    if group is None:
        return torch.logsumexp(logits, dim=-1)
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = (logits - top[:, None]).exp_().sum(dim=-1)
    dist.all_reduce(total, group=group)
    return total.log_() + top


def _target_logit(logits: torch.Tensor, local: torch.Tensor, mine: torch.Tensor, group) -> torch.Tensor:
    """Each row's logit of its label (0 where the label is ignored, or held by another rank's shard)."""
    rows = torch.arange(len(logits), device=logits.device)
    target = torch.where(mine, logits[rows, local.clamp(0, logits.shape[-1] - 1)], 0.0)
    if group is not None:
        dist.all_reduce(target, group=group)
    return target
