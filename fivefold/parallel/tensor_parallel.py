"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM") with sequence parallelism (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"), applied from outside the model by
swapping its nn.Linear / nn.Embedding modules for sharded ones.

    attention   q, k, v column-parallel (whole heads per rank: tp divides num_heads and num_kv_heads),
                o row-parallel
    MLP         gate, up column-parallel, down row-parallel
    embedding   vocabulary-parallel (rows); LM head column-parallel over the vocabulary, its logits stay
                sharded into a vocabulary-parallel cross-entropy that never gathers them

Without sequence parallelism, a column-parallel linear's input enters through `copy_to_tp` (forward
identity, backward all-reduce: Megatron's f) and a row-parallel linear's partial outputs leave through
`reduce_from_tp` (forward all-reduce, backward identity: g). With it, the norms and residual stream are
split along the sequence: column-parallel inputs are all-gathered along the sequence (backward
reduce-scatter) and row-parallel outputs reduce-scattered (backward all-gather), which moves the same
bytes as the all-reduce and divides the norm/residual activations by tp. Every communication is one
autograd.Function below, forward and backward side by side.

Parameters that stay whole on every rank (norm gains, row-parallel biases, learned positions) see only
their rank's part of the sequence under SP, so their gradients are summed over the tp group.
"""

from __future__ import annotations
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.model.moe import GroupedExperts
from fivefold.parallel.collectives import (CopyToTP, GatherSequence, GatherToReplicated, ReduceFromTP,
                                           ReduceScatterSequence, SplitSequence, all_reduce_hook, gather_sequence,
                                           in_backward)
from fivefold.train.recompute import checkpointed


def _shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> nn.Parameter:
    """This rank's slice of `full` along `dim` (on the meta device before materialisation; its place in
    the full tensor goes into the placement record, fivefold.parallel.placement)."""
    size = full.shape[dim] // tp
    return nn.Parameter(full.detach().narrow(dim, rank * size, size).clone())


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows (and b) split across ranks: each rank makes its slice of y.

    `input`: how x arrives. "copy": whole on every rank (f: backward all-reduce); "gather": split along
    the sequence (SP: all-gathered here, backward reduce-scatter); "ready": the enclosing module already
    did either, once for all its column-parallel linears (apply_tensor_parallel)."""

    def __init__(self, linear: nn.Linear, group, input: str = "copy"):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.input = group, input
        self.weight = _shard(linear.weight, 0, rank, tp)
        self.bias = _shard(linear.bias, 0, rank, tp) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input == "copy":
            x = CopyToTP.apply(x, self.group)
        elif self.input == "gather":
            x = GatherSequence.apply(x, self.group)
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The local product (QLoRA replaces it by one from a quantized weight: fivefold.finetune.qlora)."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split: each rank's partial product is summed across ranks
    (all-reduce, or reduce-scatter along the sequence under SP); b is whole, added after the sum."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(linear.weight, 1, rank, tp)
        self.bias = nn.Parameter(linear.bias.detach()) if linear.bias is not None else None  # whole: added after the sum
        # Sum a copy of the partial product (and of a LoRA adapter's A x): set in blocks recomputed under
        # train.recompute=ops, which may keep the product itself (fivefold.train.recompute).
        self.copy_partial = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.sequence_parallel:
            y = ReduceScatterSequence.apply(y, self.group)
        else:
            y = ReduceFromTP.apply(y, self.group, self.copy_partial)
        return y + self.bias if self.bias is not None else y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The local partial product (QLoRA replaces it: fivefold.finetune.qlora); the bias comes after the sum."""
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary: a rank looks up the tokens in its range, zeros elsewhere,
    and the all-reduce assembles every token's vector."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = _shard(embedding.weight, 0, rank, tp)
        self.start = rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return ReduceFromTP.apply(x.masked_fill(outside[..., None], 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits (N, V / tp): the max, the softmax
    denominator and the target's logit are each one all-reduce of N numbers; the logits are never
    gathered. Backward: softmax minus one-hot, on the local shard."""

    @staticmethod
    def forward(ctx, logits, labels, start, ignore_index, group):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, as F.cross_entropy
        max_logit = logits.max(dim=-1).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        local = labels - start
        mine = (local >= 0) & (local < logits.shape[-1])
        rows = torch.arange(len(labels), device=logits.device)
        target = torch.where(mine, logits[rows, local.clamp(0, logits.shape[-1] - 1)] - max_logit, 0.0)
        exp = (logits - max_logit[:, None]).exp_()  # one (N, V / tp) buffer: becomes the saved softmax
        denominator = exp.sum(dim=-1)
        both = torch.stack([target, denominator])
        dist.all_reduce(both, group=group)
        target, denominator = both
        keep = labels != ignore_index
        loss = torch.where(keep, denominator.log() - target, 0.0)
        exp /= denominator[:, None]  # softmax, in place: saved for backward
        ctx.save_for_backward(exp, local, mine & keep, keep)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, keep = ctx.saved_tensors
        rows = torch.arange(len(local), device=softmax.device)
        grad_logits = softmax
        grad_logits[rows[hit], local[hit]] -= 1.0
        grad_logits *= (grad * keep)[:, None]
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, start: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses (0 where labels == ignore_index) of (N, V / tp) logits whose first column is
    vocabulary id `start`."""
    return _VocabParallelCrossEntropy.apply(logits, labels, start, ignore_index, group)


class SequenceGatheredInput:
    """Under SP, the input of an attention, MLP or LM head is all-gathered along the sequence once, at
    the module's entrance, for all its column-parallel linears. Those linears save the gathered tensor
    for their weight gradients; its storage is released after the module's forward and gathered again
    just before the module's backward, so between the two only this rank's sequence shard is kept
    (Korthikanti et al. 2022, section 4.2.2: one extra all-gather in backward for 1/tp of the memory)."""

    def __init__(self, module: nn.Module, group):
        self.group = group
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)
        self._pending = None

    def _enter(self, module, args):
        x_local = args[0]
        x_full = GatherSequence.apply(x_local, self.group)
        # Inside backward (a recomputed forward) the gathered input is used at once: nothing to release.
        # In a compiled graph the partitioner decides what backward keeps, and a checkpointed block keeps
        # nothing of its forward: nothing to release either (a re-gather in backward would only make a
        # second copy beside the recomputation's, held to the end of backward).
        keep = (not torch.compiler.is_compiling() and torch.is_grad_enabled() and x_full.requires_grad
                and not in_backward() and not checkpointed())
        self._pending = (x_local.detach(), x_full) if keep else None
        return (x_full, *args[1:])

    def _leave(self, module, args, output):
        if self._pending is None:
            return output
        x_local, x_full = self._pending
        self._pending = None
        x_full.untyped_storage().resize_(0)
        group, held = self.group, [(x_local, x_full)]

        def regather(grad):
            # Taken out of the closure: once the module's backward has used it, autograd's saved reference is
            # the last one, and the gathered copy is freed then, not when the whole graph goes.
            x_local, x_full = held.pop()
            x_full.untyped_storage().resize_(x_full.numel() * x_full.element_size())
            with torch.no_grad():
                x_full.data.copy_(gather_sequence(x_local, group))  # via .data: autograd's saved reference stays valid
        output.register_hook(regather)
        return output


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool) -> dict[str, int]:
    """Swap the model's linears and embedding for their sharded versions, in place (on the meta device,
    before anything is materialised). Parameters keep their names (checkpoints and the name-seeded
    init are unchanged). Returns the axis along which each sharded parameter is split, by name."""
    # q/k/v (and gate/up, and the head) share one input: its f / all-gather runs once, at the module's
    # entrance, not once per linear.
    column_input = "ready"
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), group, column_input))
        attn.o_proj = RowParallelLinear(attn.o_proj, group, sequence_parallel)
        if hasattr(mlp, "router"):
            _shard_experts(mlp, group)
            continue
        for name in ("gate_proj", "up_proj"):
            if hasattr(mlp, name):
                setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), group, column_input))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group)
    # A head that only hands its input on (train.loss_chunk: fivefold.train.chunked_loss) keeps its own
    # input handling; its weight is split by vocabulary rows all the same.
    feature_head = not isinstance(model.lm_head, nn.Linear)
    if feature_head:
        model.lm_head.weight = _shard(model.lm_head.weight, 0, dist.get_rank(group), dist.get_world_size(group))
    else:
        model.lm_head = ColumnParallelLinear(model.lm_head, group, column_input)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    heads = [] if feature_head else [model.lm_head]
    if sequence_parallel:
        # The residual stream enters the SP region at the first block and leaves it at the LM head's
        # all-gather; replicated parameters inside it (norms, row-parallel biases) see only this rank's
        # part of the sequence, so their gradients are summed over the tp group.
        model.layers[0].register_forward_pre_hook(
            lambda module, args: (SplitSequence.apply(args[0], group), *args[1:]))
        moe = [block.mlp for block in model.layers if hasattr(block.mlp, "router")]
        for module in [*(m for block in model.layers for m in (block.attn, block.mlp) if m not in moe), *heads]:
            SequenceGatheredInput(module, group)
        # A mixture of experts routes the whole sequence on every rank, as without SP (its experts
        # bring their own f and g), between a gather and a split of the residual stream.
        for module in moe:
            module.register_forward_pre_hook(
                lambda module, args: (GatherToReplicated.apply(args[0], group), *args[1:]))
            module.register_forward_hook(lambda module, args, output: SplitSequence.apply(output, group))
        for p in _sequence_region_replicas(model):
            p.register_hook(all_reduce_hook(group))
    else:
        # A mixture of experts gets its f per expert instead (its router also reads the input, whole).
        entrances = [m for block in model.layers for m in (block.attn, block.mlp) if not hasattr(m, "router")]
        for module in [*entrances, *heads]:
            module.register_forward_pre_hook(lambda module, args: (CopyToTP.apply(args[0], group), *args[1:]))
    return sharded_axes(model)


def sharded_axes(model: nn.Module) -> dict[str, int]:
    """{parameter name: axis split across the tp group} of a tensor-parallel model."""
    axes = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            axes[f"{prefix}.weight"] = 0
            if getattr(module, "bias", None) is not None:
                axes[f"{prefix}.bias"] = 0
        elif isinstance(module, RowParallelLinear):
            axes[f"{prefix}.weight"] = 1
        elif isinstance(module, GroupedExperts):
            axes.update({f"{prefix}.{name}": axis for name, axis in EXPERT_AXES.items()})
    if not isinstance(model.lm_head, (nn.Linear, ColumnParallelLinear)):  # a feature head, split all the same
        axes["lm_head.weight"] = 0
    return axes


def _sequence_region_replicas(model: nn.Module) -> list[nn.Parameter]:
    """Whole parameters used inside the sequence-parallel region: the norms and row-parallel biases."""
    norms = [*(m for block in model.layers for m in (block.attn_norm, block.mlp_norm)), model.norm]
    params = [p for m in norms for p in m.parameters()]
    params += [m.bias for m in model.modules() if isinstance(m, RowParallelLinear) and m.bias is not None]
    return params


def _shard_experts(moe: nn.Module, group) -> None:
    """The stacked experts split like a dense MLP, each expert's gate/up by output columns and down by
    input rows, so the grouped matmul runs on every rank with its slice of every expert: the routed
    tokens enter once through f and the partial outputs leave once through g. Routing stays whole and
    identical on every rank; as the experts' f sits after the router, the router's input gradient is
    not summed over the group. The shared expert is a tensor-parallel MLP of its own."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    experts = moe.experts
    for name, axis in EXPERT_AXES.items():
        setattr(experts, name, _shard(getattr(experts, name), axis, rank, tp))
    experts.register_forward_pre_hook(lambda module, args: (CopyToTP.apply(args[0], group), *args[1:]))
    experts.register_forward_hook(lambda module, args, output: ReduceFromTP.apply(output, group))
    shared = moe.shared_expert
    if shared is not None:
        shared.gate_proj = ColumnParallelLinear(shared.gate_proj, group, "copy")
        shared.up_proj = ColumnParallelLinear(shared.up_proj, group, "copy")
        shared.down_proj = RowParallelLinear(shared.down_proj, group, sequence_parallel=False)


# The axis of each stacked expert weight (E, out, in) that tensor parallelism splits: the expert width f.
EXPERT_AXES = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
