"""The collectives that tensor and sequence parallelism, LoRA under tp, ZeRO and the chunked loss share:
each communication one autograd.Function, forward and backward side by side (Megatron's f and g, and
their sequence-parallel forms), plus the tensor all-gather / reduce-scatter these build on."""

from __future__ import annotations

import torch
import torch.distributed as dist

# The single-tensor collectives (newer torch names them *_single; older, *_into_tensor / *_tensor).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward (each rank used the input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of partial sums forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group, copy=False):
        # In place, unless x may be a matmul output that train.recompute=ops keeps for backward (`copy`):
        # the kept tensor must stay the partial product. Decided per module, not per pass, so that the
        # recomputation runs the same ops as the forward did.
        x = x.clone(memory_format=torch.contiguous_format) if copy else x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, s, ...) per rank -> (B, tp * s, ...), ranks in order along the sequence."""
    tp = dist.get_world_size(group)
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group=group)  # rank-major along dim 0, as the collective requires
    return out.view(tp, *x.shape).movedim(0, 1).flatten(1, 2)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S, ...) partial sums on every rank -> this rank's (B, S / tp, ...) of the sum."""
    tp = dist.get_world_size(group)
    b, s = x.shape[:2]
    chunks = x.reshape(b, tp, s // tp, *x.shape[2:]).movedim(1, 0).contiguous()  # rank-major
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, chunks.flatten(0, 1), group=group)
    return out


def own_part(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice along the sequence of a (B, S, ...) tensor every rank holds whole."""
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class GatherSequence(torch.autograd.Function):
    """SP into a column-parallel linear: all-gather along the sequence; backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """SP out of a row-parallel linear: reduce-scatter along the sequence; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


class SplitSequence(torch.autograd.Function):
    """Into the SP region from a replicated tensor: keep this rank's part; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_part(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


class GatherToReplicated(torch.autograd.Function):
    """Out of the SP region into a replicated computation whose input gradient is the same on every rank
    (a mixture of experts: routing reads every token): all-gather along the sequence; backward keeps
    this rank's part of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return own_part(grad, ctx.group), None


def all_reduce_hook(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


def in_backward() -> bool:
    """True while autograd's engine runs (e.g. a recomputed forward inside backward)."""
    return torch._C._current_graph_task_id() != -1
