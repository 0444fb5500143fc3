"""Context-parallel attention time: our ring attention (fivefold.parallel.context_parallel), forward and
backward on each rank's zig-zag tokens, against the all-gather form of context parallelism (every rank
gathers the whole sequence's keys and values, runs PyTorch's SDPA on its queries against all of them
with the causal mask of its global positions, and reduce-scatters the key/value gradients back: Llama 3's
choice), against the same ring with every send/receive waited on at once (no overlap), and against the
same ring computing its blocks as explicit matmuls and softmax (what it does with packed documents, and
did everywhere before its blocks ran the fused CPU kernel), on the same gloo process group and the same
tensors.

    python bench/context_parallel.py --nproc 2 --json bench/results/context_parallel_cp2.json
    python bench/context_parallel.py --nproc 2 --seq-len 8192 --heads 8 --kv-heads 2

The first step checks that all four give the same output and gradients (fp32, within 1e-4 relative);
then one-step windows alternate between them and the medians are printed as ratios. The all-gather
form holds the whole sequence's keys and values (cp times ours) and, through SDPA's mask, an
(s/cp x s) score block; the ring holds one block at a time.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data_parallel import machine_info, main, time_alternating, write_json
from fivefold.parallel import context_parallel as cpmod
from fivefold.parallel.context_parallel import RingAttentionCore, zigzag_positions


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="cp ranks to launch (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads per rank")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096, help="whole sequence; each rank holds seq-len / cp")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


class _BlockingShift(cpmod._Shift):
    """The ring's shift, waited on as soon as it is posted: no transfer overlaps compute."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for work in self.works:
            work.wait()
        self.works = []  # gloo: a second wait on a finished send blocks


class Attention:
    """One forward and backward of an attention implementation on this rank's q, k, v."""

    def __init__(self, fn, q, k, v, grad):
        self.fn, self.inputs, self.grad = fn, (q, k, v), grad

    def run(self):
        leaves = [t.detach().clone().requires_grad_() for t in self.inputs]
        out = self.fn(*leaves)
        out.backward(self.grad)
        return out.detach(), [t.grad for t in leaves]

    def step(self):
        self.run()

    def peak_bytes(self) -> int:
        """Largest sum of the tensors one forward and backward allocates while they are alive (the
        fivefold memory tracker: every op's outputs, until they are freed)."""
        from fivefold.memory.tracker import MemoryTracker
        from fivefold.memory.units import CATEGORIES

        with MemoryTracker(torch.nn.Module()) as tracker:
            self.run()
        return max(sum(row[:len(CATEGORIES)]) for row in tracker.samples)


def ring(groups, blocking: bool = False, explicit: bool = False):
    core = RingAttentionCore(type("Core", (), {"groups": groups})(), dist.group.WORLD)

    def attend(q, k, v):
        shift, fused = cpmod._Shift, cpmod._fused
        cpmod._Shift = _BlockingShift if blocking else shift
        cpmod._fused = (lambda q: False) if explicit else fused
        try:
            return core(q, k, v)
        finally:
            cpmod._Shift, cpmod._fused = shift, fused
    return attend


def all_gather_attention(seq: int, groups: int):
    """Gather every rank's keys and values (autograd: the backward reduce-scatters their gradients), put
    them in sequence order, and attend with SDPA under the causal mask of this rank's global positions."""
    from torch.distributed.nn.functional import all_gather

    cp, rank = dist.get_world_size(), dist.get_rank()
    order = torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)]).argsort()
    mask = zigzag_positions(seq, cp, rank)[:, None] >= torch.arange(seq)[None, :]

    def attend(q, k, v):
        kv = torch.cat(all_gather(torch.stack([k, v])), dim=3)[:, :, :, order]
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=groups > 1)
    return attend


def worker(args) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    cp, rank = dist.get_world_size(), dist.get_rank()
    if args.seq_len % (2 * cp):
        raise SystemExit(f"--seq-len {args.seq_len} must divide by 2 x cp = {2 * cp}")
    g = torch.Generator().manual_seed(rank)
    s, d = args.seq_len // cp, args.head_size
    q = torch.randn(args.batch, args.heads, s, d, generator=g)
    k, v = (torch.randn(args.batch, args.kv_heads, s, d, generator=g) for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    groups = args.heads // args.kv_heads
    runners = {"ring": Attention(ring(groups), q, k, v, grad),
               "ring_blocking": Attention(ring(groups, blocking=True), q, k, v, grad),
               "ring_explicit_blocks": Attention(ring(groups, explicit=True), q, k, v, grad),
               "all_gather_sdpa": Attention(all_gather_attention(args.seq_len, groups), q, k, v, grad)}
    results = {name: r.run() for name, r in runners.items()}
    worst = 0.0
    for name in ("ring_blocking", "ring_explicit_blocks", "all_gather_sdpa"):
        for a, b in zip([results["ring"][0], *results["ring"][1]], [results[name][0], *results[name][1]]):
            worst = max(worst, ((a - b).norm() / b.norm()).item())
    if worst > 1e-4:
        raise SystemExit(f"rank {rank}: implementations disagree (relative difference {worst:.2e})")
    peaks = {name: r.peak_bytes() for name, r in runners.items()}
    times, _ = time_alternating(runners, args.warmup, args.steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    out = {"machine": machine_info(args, cp), "cp": cp, "batch": args.batch, "seq_len": args.seq_len,
           "heads": args.heads, "kv_heads": args.kv_heads, "head_size": d, "max_relative_difference": worst,
           "median_seconds": median, "peak_bytes": peaks,
           "ratio_ring_over_all_gather": median["ring"] / median["all_gather_sdpa"],
           "ratio_ring_over_blocking_ring": median["ring"] / median["ring_blocking"],
           "ratio_ring_over_explicit_blocks": median["ring"] / median["ring_explicit_blocks"]}
    if rank == 0:
        print(f"cp={cp}, batch {args.batch} x seq {args.seq_len}, heads {args.heads}/{args.kv_heads} x {d}: "
              f"fwd+bwd median ms " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in median.items()))
        print(f"ratio ring / all-gather + SDPA: {out['ratio_ring_over_all_gather']:.3f}; ring / ring without "
              f"overlap: {out['ratio_ring_over_blocking_ring']:.3f}; fused blocks / explicit blocks: "
              f"{out['ratio_ring_over_explicit_blocks']:.3f} (max relative difference {worst:.1e})")
        print("peak MB allocated in one forward + backward: " + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in peaks.items()))
        write_json(args.json, out)


if __name__ == "__main__":
    main(parse_args, worker, __file__)
