"""Run under torchrun by tests/test_context_parallel.py: ring attention on zig-zag shards against full
causal attention, forward and backward, in float64, with and without grouped-query heads, and with
packed documents (causal within each document) against SDPA with the same mask; in float32 and bfloat16
too (the fused CPU kernel's blocks in the working precisions), against float64 within their rounding."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.parallel import context_parallel
from fivefold.parallel.context_parallel import DocumentBlocks, RingAttentionCore, zigzag_positions
from fivefold.parallel.mesh import exit_worker

SENT = []


class CountingShift(context_parallel._Shift):
    def __init__(self, x, group, tag, direction=1):
        SENT.append(x.numel() * x.element_size())
        super().__init__(x, group, tag, direction)


context_parallel._Shift = CountingShift


class _Core:
    def __init__(self, groups):
        self.groups = groups


if __name__ == "__main__":
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    # (query heads, key/value heads, packed documents, dtype, largest error allowed)
    cases = ((4, 4, False, torch.float64, 1e-10), (4, 2, False, torch.float64, 1e-10),
             (4, 2, True, torch.float64, 1e-10), (4, 2, False, torch.float32, 1e-5),
             (4, 2, False, torch.bfloat16, 2e-2))
    for heads, kv_heads, packed, dtype, tolerance in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 8 * cp, 8, dtype=torch.float64, generator=g) for h in (heads, kv_heads, kv_heads))
        seq = q.shape[2]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask, blocks = None, None
        if packed:  # documents of random lengths, so boundaries fall inside and across ranks' chunks
            starts = (torch.rand(2, seq, generator=g) < 0.15).long()
            starts[:, 0] = 0
            doc_ids = starts.cumsum(1)
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()
            mask = (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
            ref = F.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=heads != kv_heads)
        else:
            ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=heads != kv_heads)
        grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
        ref.backward(grad)
        cols = zigzag_positions(seq, cp, rank)
        if packed:
            blocks = DocumentBlocks(doc_ids[:, cols], dist.group.WORLD)
        mine = [t[:, :, cols].to(dtype).requires_grad_() for t in (q, k, v)]
        SENT.clear()
        out = RingAttentionCore(_Core(heads // kv_heads), dist.group.WORLD)(*mine, mask=blocks)
        out.backward(grad[:, :, cols].to(dtype))
        # What the planner charges one attention (fivefold.memory.communication), here in float64.
        kv, size = 2 * k[:, :, cols].numel(), torch.finfo(dtype).bits // 8
        gradient = torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8  # accumulated in fp32 at least
        assert sum(SENT) == kv * size * (cp - 1) * 2 + kv * gradient * cp, (sum(SENT), kv)
        for what, a, b in (("output", out, ref[:, :, cols]), *((f"grad {n}", m.grad, f.grad[:, :, cols])
                                                                for n, m, f in zip("qkv", mine, full))):
            err = ((a.double() - b).abs().max() / b.abs().max()).item()
            assert err < tolerance, f"rank {rank} {dtype} heads {heads}/{kv_heads} packed {packed}: {what} differs by {err:.2e}"
    dist.barrier()
    if rank == 0:
        print("ring attention matches full attention")
    exit_worker()
