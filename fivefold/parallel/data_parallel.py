"""Data parallelism: gradients summed across the dp group in buckets, launched from backward hooks.

Parameters are grouped into buckets of about `bucket_bytes` in reverse order of registration, which is
roughly the order their gradients become ready in backward. When the last gradient of a bucket is ready
on the step's final micro-batch, the bucket is flattened into one fp32 buffer and an asynchronous
all-reduce starts, so communication overlaps the rest of backward (Li et al. 2020, "PyTorch
Distributed", section 3.2). Accumulation micro-batches communicate nothing.

The reduction is a SUM, not a mean: the trainer already divides every micro-batch loss by the token
count of the whole global batch, so summing over ranks gives the global-mean gradient exactly as one
process would compute it. The sums stay in fp32 and the optimizer reads them from the buckets, so
bf16 gradients are never rounded back to bf16 after the reduction.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.hooks import weak


def size_buckets(numels: list[int], bucket_bytes: int, first_bucket_bytes: int = 2**20) -> list[list[int]]:
    """Indices of parameters (given by element count, in registration order) cut into fp32 buckets, in
    reverse order: roughly the order backward makes their gradients. The first bucket (the last layers'
    gradients, ready first) is small, as DDP's is, and none holds more than a quarter of all gradients,
    so that communication starts early and overlaps backward even when the whole model would fit one
    `bucket_bytes` bucket. The memory planner sizes ZeRO-2's in-flight gradients with this too."""
    total_bytes = 4 * sum(numels)
    first_bucket_bytes = min(first_bucket_bytes, bucket_bytes)
    bucket_bytes = min(bucket_bytes, max(first_bucket_bytes, total_bytes // 4))
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += numels[i] * 4
        if size >= (first_bucket_bytes if not buckets else bucket_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class TimedWaits:
    """Waits on collective handles, timed: `wait_seconds` is the communication backward did not hide."""

    def __init__(self):
        self.wait_seconds = 0.0

    def wait(self, work) -> None:
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start


class AllReduceBucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0
        self.buffer: torch.Tensor | None = None
        self.work = None
        self.present: list[bool] = []  # which of the parameters had a gradient on this rank


class BucketedAllReduce(TimedWaits):
    reduces_every_micro_batch = False

    def __init__(self, params: list[nn.Parameter], group, grad_of=None, bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = 2**20, overlap: bool = True):
        """`grad_of(param)` returns the tensor holding that parameter's gradient (its .grad by default, or
        an fp32 accumulation buffer whose hook must have been registered before this one's).

        `overlap=False` reduces every bucket in finish(), in order: for parameters that may get no
        gradient on some ranks (experts no token was routed to), where launching buckets as they fill
        would launch them in a different order on different ranks."""
        super().__init__()
        self.params, self.group, self.overlap = list(params), group, overlap
        self.grad_of = grad_of or (lambda p: p.grad)
        self.sync = True
        self.buckets = [AllReduceBucket([self.params[i] for i in b])
                        for b in size_buckets([p.numel() for p in self.params], bucket_bytes, first_bucket_bytes)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.reduced: dict[nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak(self._grad_ready))

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync or not self.overlap:
            return
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: AllReduceBucket) -> None:
        grads = [self.grad_of(p) for p in bucket.params]
        bucket.present = [g is not None for g in grads]
        flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, bucket.params)]
        if not self.overlap:
            # Parameters that got no gradient here contribute zeros, so every rank reduces equal shapes; a count
            # of the ranks that had one rides along, so that a parameter no rank touched keeps no gradient (the
            # optimizer then leaves it alone, as one process would: an expert no token chose). Filled on the
            # device: a list copied from the host would make the host wait for the device mid-backward.
            had = torch.ones(len(grads), dtype=torch.float32, device=bucket.params[0].device)
            for i, present in enumerate(bucket.present):
                if not present:
                    had[i] = 0.0
            flat.append(had)
        # Overlapped buckets hold parameters that get a gradient on every rank or on none (the same layers
        # run everywhere; experts, which may not, are reduced with overlap=False): their presence here is
        # every rank's, and finish() need not read it back from the device.
        bucket.buffer = torch.cat(flat)
        for p in bucket.params:
            p.grad = None  # the bucket holds it now
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (launching any whose gradients did not all arrive); the sums become
        `local_grads()`."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
            self.wait(bucket.work)
            offset = 0
            had = bucket.present if self.overlap else bucket.buffer[-len(bucket.params):].tolist()
            for p, count in zip(bucket.params, had):
                if count:
                    self.reduced[p] = bucket.buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            bucket.ready, bucket.buffer, bucket.work = 0, None, None

    def local_grads(self) -> list[torch.Tensor | None]:
        """The reduced fp32 gradients in parameter order; handed over (the reducer keeps no reference)."""
        grads = [self.reduced.get(p) for p in self.params]
        self.reduced = {}
        return grads

    def zero_grad(self) -> None:
        self.reduced = {}

    def memory_roles(self) -> dict[str, list[torch.Tensor]]:
        """Tensors the memory tracker should count by role: the fp32 reduced gradients."""
        in_flight = [b.buffer for b in self.buckets if b.buffer is not None]
        return {"gradients": in_flight + list(self.reduced.values())}


class Reducers:
    """Reducers over disjoint parameter sets (e.g. expert parameters over their own group), driven as
    one. Parameters no reducer covers keep their local gradient (`grad_of`)."""

    reduces_every_micro_batch = False

    def __init__(self, params: list[nn.Parameter], reducers: list, grad_of=None):
        self.params, self.reducers = list(params), reducers
        self.grad_of = grad_of or (lambda p: p.grad)

    @property
    def sync(self) -> bool:
        return all(r.sync for r in self.reducers)

    @sync.setter
    def sync(self, value: bool) -> None:
        for r in self.reducers:
            r.sync = value

    @property
    def wait_seconds(self) -> float:
        return sum(r.wait_seconds for r in self.reducers)

    def finish(self) -> None:
        for r in self.reducers:
            r.finish()

    def local_grads(self) -> list[torch.Tensor | None]:
        """Handed over, like every reducer's: an uncovered parameter's .grad is released here, or the
        optimizer's chunked step would see it in every chunk before its own."""
        reduced = {}
        for r in self.reducers:
            reduced.update(zip(r.params, r.local_grads()))
        out = []
        for p in self.params:
            grad = reduced[p] if p in reduced else self.grad_of(p)
            if grad is p.grad:
                p.grad = None
            out.append(grad)
        return out

    def zero_grad(self) -> None:
        for r in self.reducers:
            r.zero_grad()

    def memory_roles(self) -> dict[str, list[torch.Tensor]]:
        roles: dict[str, list] = {}
        for r in self.reducers:
            for role, tensors in r.memory_roles().items():
                roles.setdefault(role, []).extend(tensors)
        return roles
