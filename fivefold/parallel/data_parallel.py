"""Data parallelism: gradients summed across the dp group in buckets, launched from backward hooks.

Parameters are grouped into buckets of about `bucket_bytes` in reverse order of registration, which is
roughly the order their gradients become ready in backward. When the last gradient of a bucket is ready
on the step's final micro-batch, the bucket is flattened into one fp32 buffer and an asynchronous
all-reduce starts, so communication overlaps the rest of backward (Li et al. 2020, "PyTorch
Distributed", section 3.2). Accumulation micro-batches communicate nothing.

The reduction is a SUM, not a mean: the trainer already divides every micro-batch loss by the token
count of the whole global batch, so summing over ranks gives the global-mean gradient exactly as one
process would compute it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.buffer: torch.Tensor | None = None
        self.work = None


class BucketedAllReduce:
    def __init__(self, params: list[nn.Parameter], group, grad_of, bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = 2**20):
        """`grad_of(param)` returns the tensor holding that parameter's gradient (its .grad, or an fp32
        accumulation buffer); hooks registered after the optimizer's see the gradient already folded.

        The first bucket (the last layers' gradients, ready first) is kept small, as DDP does, and no
        bucket holds more than a quarter of all gradients, so that communication starts early in
        backward and overlaps it even when the whole model would fit one `bucket_bytes` bucket."""
        self.group, self.grad_of = group, grad_of
        self.sync = True
        self.buckets: list[_Bucket] = []
        total_bytes = 4 * sum(p.numel() for p in params)  # buckets hold fp32
        bucket_bytes = min(bucket_bytes, max(first_bucket_bytes, total_bytes // 4))
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(list(params)):
            current.append(p)
            size += p.numel() * 4
            if size >= (first_bucket_bytes if not self.buckets else bucket_bytes):
                self.buckets.append(_Bucket(len(self.buckets), current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(len(self.buckets), current))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [self.grad_of(p) for p in bucket.params]
        # Parameters that got no gradient this step contribute zeros, so every rank reduces equal shapes.
        bucket.buffer = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                                   for g, p in zip(grads, bucket.params)])
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (launching any whose gradients did not all arrive) and write the sums back."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                reduced = bucket.buffer[offset:offset + n].view_as(p)
                grad = self.grad_of(p)
                if grad is None:
                    p.grad = reduced.to(p.dtype)
                else:
                    grad.copy_(reduced)
                offset += n
            bucket.ready, bucket.buffer, bucket.work = 0, None, None
