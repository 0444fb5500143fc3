"""Context parallelism: each sequence is split across the cp ranks, and attention runs as ring attention
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"): every rank keeps its queries and passes
its keys and values around the ring; at each step it attends to the block it holds and the partial
results are merged with the log-sum-exp rule (the online softmax of FlashAttention). The ring shift is
an autograd Function, so backward rings too, in the opposite direction, carrying the key and value
gradients back to their owners.

Causal load balance (zig-zag): with the sequence cut into 2 cp chunks, rank r holds chunks r and
2cp - 1 - r, so every rank has the same amount of causal work. Tokens keep their global positions
(RoPE) and causality is decided on positions.

Everything outside attention is per token, so the rest of the model runs unchanged on the local tokens;
parameter gradients are partial sums over the rank's tokens and are reduced over dp x cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


class _RingShift(torch.autograd.Function):
    """Send x to the next rank of the ring, receive the previous rank's; backward the reverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group, direction: int) -> torch.Tensor:
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    to, frm = ranks[(me + direction) % len(ranks)], ranks[(me - direction) % len(ranks)]
    x = x.contiguous()
    out = torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to), dist.P2POp(dist.irecv, out, frm)])
    for work in works:
        work.wait()
    return out


class RingAttentionCore(nn.Module):
    """Drop-in for AttentionCore on this rank's zig-zag tokens: causal attention over the whole
    sequence, computed block by block as the keys and values come round."""

    def __init__(self, core: nn.Module, group):
        super().__init__()
        self.groups, self.group = core.groups, group

    def forward(self, q, k, v, mask=None):
        # q (B, H, s, d); k, v (B, Hkv, s, d) for this rank's s = S / cp tokens. `mask` is the model's
        # local causal mask, meaningless across ranks: causality comes from global positions here.
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        seq = q.shape[2] * cp
        pos_q = zigzag_positions(seq, cp, rank, q.device)
        scale = q.shape[-1] ** -0.5
        outs, lses = [], []
        kv = torch.stack([k, v])
        for step in range(cp):
            if step:
                kv = _RingShift.apply(kv, self.group)
            k_j, v_j = kv[0], kv[1]
            if self.groups > 1:
                k_j, v_j = k_j.repeat_interleave(self.groups, 1), v_j.repeat_interleave(self.groups, 1)
            allowed = pos_q[:, None] >= zigzag_positions(seq, cp, (rank - step) % cp, q.device)[None, :]
            out, lse = _block_attention(q, k_j, v_j, allowed, scale)
            outs.append(out)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        return sum(torch.exp(lse_j - lse)[..., None] * out_j for lse_j, out_j in zip(lses, outs)).to(q.dtype)


def _block_attention(q, k, v, allowed, scale):
    """softmax(q k^T) v over one key block and its log-sum-exp, both as if the block were all the keys.
    Rows with no allowed key get output 0 and lse -inf (weight 0 when merged), with no NaN in backward."""
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 at least
    scores = (q @ k.transpose(-2, -1)).to(acc) * scale
    any_allowed = allowed.any(-1)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~any_allowed[:, None], 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).masked_fill(~allowed, 0.0)
    out = probs.to(v.dtype) @ v
    return out.to(acc), torch.where(any_allowed, lse, float("-inf"))


def apply_context_parallel(model: nn.Module, group) -> None:
    """Swap every block's attention core for ring attention over `group`."""
    for block in model.layers:
        if hasattr(block, "attn"):
            block.attn.core = RingAttentionCore(block.attn.core, group)
