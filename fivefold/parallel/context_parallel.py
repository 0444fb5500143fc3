"""Context parallelism: each sequence is split across the cp ranks, and attention runs as ring attention
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"): every rank keeps its queries and passes
its keys and values around the ring; at each step it attends to the block it holds and the partial
results are merged with the log-sum-exp rule (the online softmax of FlashAttention). Backward rings
too: the blocks go round again with their key and value gradients, which end at their owners.

Causal load balance (zig-zag): with the sequence cut into 2 cp chunks, rank r holds chunks r and
2cp - 1 - r, so every rank has the same amount of causal work. Tokens keep their global positions
(RoPE) and causality is decided on positions; with packed documents, also on the tokens' global
document ids, gathered once per forward so each block's mask is built where it is used.

Everything outside attention is per token, so the rest of the model runs unchanged on the local tokens;
parameter gradients are partial sums over the rank's tokens and are reduced over dp x cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.model.moe import MoE


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


class _Shift:
    """An asynchronous ring step: x goes to the next rank (previous for direction -1) while the block
    from the other side arrives; `wait()` returns it. Started before a block's compute, so the transfer
    overlaps it. Each stream of blocks has its own tag, as two shifts to the same peer may be in flight."""

    def __init__(self, x: torch.Tensor, group, tag: int, direction: int = 1):
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        to, frm = ranks[(me + direction) % len(ranks)], ranks[(me - direction) % len(ranks)]
        self.out = torch.empty_like(x)
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), to, tag=tag),
                                             dist.P2POp(dist.irecv, self.out, frm, tag=tag)])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.out


KV_TAG, GRAD_TAG = 1, 2


def _allowed(seq: int, cp: int, rank: int, source: int, device, docs: torch.Tensor | None) -> torch.Tensor:
    """Mask of this rank's queries against the keys of rank `source`: causal by global position, (s, s);
    with document ids `docs` (cp, B, s), also within the same document, (B, 1, s, s)."""
    causal = zigzag_positions(seq, cp, rank, device)[:, None] >= zigzag_positions(seq, cp, source, device)[None, :]
    if docs is None:
        return causal
    return (causal & (docs[rank][:, :, None] == docs[source][:, None, :]))[:, None]


class DocumentBlocks:
    """The attention mask ring attention is given for packed documents: every rank's tokens' document ids
    (cp, B, s), gathered once per forward, from which each block's mask is built as the block arrives."""

    def __init__(self, doc_ids: torch.Tensor, group):
        parts = [torch.empty_like(doc_ids) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, doc_ids.contiguous(), group=group)
        self.docs = torch.stack(parts)


def _visible(rank: int, source: int, s: int) -> tuple[slice, slice]:
    """The queries (rows) and keys (columns) of the block from rank `source` that causality can let
    through: all of the diagonal block; of an earlier rank's, only its first chunk of keys (its second
    chunk lies after all of ours); of a later rank's, only our second chunk of queries. Off the diagonal
    that is half the block, computed without the other half."""
    if source == rank:
        return slice(None), slice(None)
    if source < rank:
        return slice(None), slice(0, s // 2)
    return slice(s // 2, None), slice(None)


def _scores(q, k, allowed, scale):
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 at least
    return (q @ k.transpose(-2, -1)).to(acc).mul_(scale).masked_fill_(~allowed, float("-inf"))


def _fused(q: torch.Tensor) -> bool:
    """Whether the blocks run as the fused flash-attention kernel that also returns the log-sum-exp: on
    the CPU, for every dtype. Elsewhere the blocks run as explicit matmuls (their s/cp x s/cp scores live
    only while the block is computed)."""
    return q.device.type == "cpu"


def _document_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The packed documents' block mask as the fused kernel takes it: additive, in the inputs' dtype."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _flash_forward(q, k, v, causal: bool, scale: float, bias=None):
    """One block's (output, log-sum-exp) by the CPU's flash kernel: no scores are materialised."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def _flash_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    """One block's (grad q, grad k, grad v). Given the final output and log-sum-exp of these queries, the
    kernel's softmax exp(s - lse) is the whole sequence's restricted to this block, and its
    rowsum(dO * O) is the whole sequence's too: the block's share of the gradients exactly."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _block_kv(kv: torch.Tensor, cols: slice, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[:, :, cols].repeat_interleave(groups, 1) if groups > 1 else t[:, :, cols] for t in kv)


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag tokens over the whole sequence.

    Forward: the key/value block goes round the ring (cp - 1 shifts); each block's output and
    log-sum-exp are merged into the running ones (online softmax). Only q, k, v, the output and the
    final log-sum-exp are saved: no s x s scores outlive a block, and with the fused kernel none exist.
    Backward: the blocks go round again, each carrying the gradient of its keys and values; every rank
    adds its queries' contribution (softmax recomputed from the saved log-sum-exp, FlashAttention-2's
    backward), and a last shift returns each gradient to the rank that owns the block.

    The diagonal block is causal in the rank's own (increasing) positions; off the diagonal the visible
    half is wholly visible (_visible). Packed documents add a mask per block, built as the block comes."""

    @staticmethod
    def forward(ctx, q, k, v, groups, group, docs):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        seq, scale = q.shape[2] * cp, q.shape[-1] ** -0.5
        acc = torch.promote_types(q.dtype, torch.float32)
        fused = _fused(q)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            incoming = _Shift(kv, group, KV_TAG) if step < cp - 1 else None  # overlaps this block's compute
            source = (rank - step) % cp
            rows, cols = _visible(rank, source, q.shape[2])
            k_j, v_j = _block_kv(kv, cols, groups)
            # The block's mask: packed documents need one, explicit blocks always take one.
            allowed = None if fused and docs is None else _allowed(seq, cp, rank, source, q.device, docs)[..., rows, cols]
            if fused:
                bias = None if allowed is None else _document_bias(allowed, q.dtype)
                block, block_lse = _flash_forward(q[:, :, rows], k_j, v_j, source == rank and bias is None,
                                                  scale, bias)
                if bias is not None:  # the kernel gives a query with no key of its document here lse 0
                    block_lse = block_lse.masked_fill(~allowed.any(-1), float("-inf"))
                if step == 0:  # the diagonal block: every query sees at least itself
                    out[:, :, rows], lse[:, :, rows] = block, block_lse
                else:
                    old_lse = lse[:, :, rows]
                    new_lse = torch.logaddexp(old_lse, block_lse)
                    out[:, :, rows] = (out[:, :, rows] * torch.exp(old_lse - new_lse)[..., None]
                                       + block.to(acc) * torch.exp(block_lse - new_lse)[..., None])
                    lse[:, :, rows] = new_lse
            else:
                scores = _scores(q[:, :, rows], k_j, allowed, scale)
                old_lse = lse[:, :, rows]
                new_lse = torch.logaddexp(old_lse, torch.logsumexp(scores, dim=-1))
                seen = torch.isfinite(new_lse)  # rows with no allowed key yet keep out = 0, lse = -inf
                old_weight = torch.where(seen, torch.exp(old_lse - new_lse), 0.0)
                probs = torch.exp(scores - torch.where(seen, new_lse, 0.0)[..., None])
                out[:, :, rows] = out[:, :, rows] * old_weight[..., None] + probs.to(v.dtype) @ v_j
                lse[:, :, rows] = new_lse
            if incoming is not None:
                kv = incoming.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.groups, ctx.group, ctx.docs = groups, group, docs
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        groups, group, docs = ctx.groups, ctx.group, ctx.docs
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        seq, scale = q.shape[2] * cp, q.shape[-1] ** -0.5
        acc = lse.dtype
        fused = _fused(q)
        if fused:
            grad_out = grad_out.to(q.dtype).contiguous()
        else:
            grad_out, out = grad_out.to(acc), out.to(acc)
            delta = (grad_out * out).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        passing = None  # the held block's gradient so far, on its way from the previous rank
        for step in range(cp):
            incoming = _Shift(kv, group, KV_TAG) if step < cp - 1 else None
            source = (rank - step) % cp
            rows, cols = _visible(rank, source, q.shape[2])
            k_j, v_j = _block_kv(kv, cols, groups)
            q_i, grad_out_i = q[:, :, rows], grad_out[:, :, rows]
            allowed = None if fused and docs is None else _allowed(seq, cp, rank, source, q.device, docs)[..., rows, cols]
            if fused:
                bias = None if allowed is None else _document_bias(allowed, q.dtype)
                grad_q_i, grad_k, grad_v = _flash_backward(grad_out_i, q_i, k_j, v_j, out[:, :, rows],
                                                           lse[:, :, rows], source == rank and bias is None,
                                                           scale, bias)
                grad_q[:, :, rows] += grad_q_i
            else:
                scores = _scores(q_i, k_j, allowed, scale)
                probs = torch.exp(scores - lse[:, :, rows, None])  # the final softmax, restricted to this block
                grad_v = probs.transpose(-2, -1) @ grad_out_i
                grad_scores = probs * (grad_out_i @ v_j.to(acc).transpose(-2, -1) - delta[:, :, rows]) * scale
                grad_q[:, :, rows] += grad_scores @ k_j.to(acc)
                grad_k = grad_scores.transpose(-2, -1) @ q_i.to(acc)
            if groups > 1:  # each key/value head served `groups` query heads
                grad_k, grad_v = (g.unflatten(1, (-1, groups)).sum(2) for g in (grad_k, grad_v))
            grad_kv = passing.wait() if passing is not None else torch.zeros(kv.shape, dtype=acc, device=q.device)
            grad_kv[:, :, :, cols] += torch.stack([grad_k, grad_v])
            passing = _Shift(grad_kv, group, GRAD_TAG)  # after the last block: back to its owner
            if incoming is not None:
                kv = incoming.wait()
        grad_kv = passing.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


class RingAttentionCore(nn.Module):
    """Drop-in for AttentionCore on this rank's zig-zag tokens: causal attention over the whole
    sequence, computed block by block as the keys and values come round."""

    def __init__(self, core: nn.Module, group):
        super().__init__()
        self.groups, self.group = core.groups, group

    def forward(self, q, k, v, mask=None):
        # q (B, H, s, d); k, v (B, Hkv, s, d) for this rank's s = S / cp tokens. Causality comes from
        # global positions; `mask` is None or the DocumentBlocks of packed documents.
        docs = mask.docs if isinstance(mask, DocumentBlocks) else None
        return _RingAttention.apply(q, k, v, self.groups, self.group, docs)


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """A statistic summed over the cp ranks (routing counts: no gradient flows through them)."""
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def apply_context_parallel(model: nn.Module, group) -> None:
    """Swap every block's attention core for ring attention over `group`, and let mixtures of experts
    sum their routing counts over it (their router losses are means over the micro-batch). With packed
    documents, each forward's ForwardContext must carry `mask=DocumentBlocks(global doc ids, group)`: a
    local (s, s) mask means nothing across ranks (fivefold.train.parallelize does this)."""
    for block in model.layers:
        if hasattr(block, "attn"):
            block.attn.core = RingAttentionCore(block.attn.core, group)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.distribute(sum_over_sequence=lambda t: _summed(t, group))
