"""ZeRO stages 1, 2 and 3 over the data-parallel group (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Every parameter is split along dim 0 into dp chunks of ceil(rows / dp) rows, the last ones shorter or
empty: torch.chunk's rule, which is also DTensor's Shard(0), so a rank's chunk is exactly its local
tensor in a sharded checkpoint (fivefold.checkpoint). Each rank owns the fp32 master weights and
Adam moments of its chunks only.

    stage 1  gradients are reduce-scattered on the step's last micro-batch; each rank updates its chunks
             and the new parameters are all-gathered.
    stage 2  as 1, but every micro-batch's gradients are reduce-scattered as their bucket fills and
             folded into an fp32 shard, so no rank holds a full set of gradients across micro-batches.
    stage 3  as 2, and parameters live only as chunks: a block's are all-gathered just before its
             forward and again before its backward (the next block's gather is prefetched), and freed
             after use. Embeddings, final norm and head are gathered for the whole forward and backward
             (they are used at both ends of the model, as FSDP does with its root).

Under train.precision=fp8 with its weights cast once a step (Config.fp8_cast_once), stage 3 gathers the float8 linears' weights as
float8: each unit's shard holds them after its other parameters, and after every step each rank casts its
rows with the whole weight's scale (one all-reduce of the amaxes) into a float8 shard that is gathered in
place of those rows (fivefold.train.fp8). The bf16 parameters of those weights are never gathered.

Collectives move groups of parameters at once. A group's buffer holds, in rank order, every rank's
chunks of the group's parameters back to back, zero-padded to full chunks: the layout reduce-scatter
consumes and all-gather produces. Gradients are reduced in fp32 whatever the compute dtype, and land in
fp32 shards the optimizer reads directly.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from fivefold.checkpoint.pieces import Piece
from fivefold.model.init import give_memory
from fivefold.parallel.collectives import all_gather_into, in_backward, reduce_scatter_into
from fivefold.parallel.data_parallel import TimedWaits, size_buckets
from fivefold.parallel.hooks import weak
from fivefold.train.fp8 import WEIGHT_DTYPE, cast_weights, multiply_by_cast

# Gradient reduce-scatters a rank lets run at once (fivefold.memory.plan counts their buffers).
MAX_REDUCES_IN_FLIGHT = 2

# torch 2.13 renamed the flat collectives; older versions only have the former names.


def chunk_range(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 chunk: torch.chunk's split, the same as DTensor's Shard(0)."""
    size = math.ceil(rows / dp)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def own_rows(value: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 chunk of a (local) parameter value: a view."""
    return value[slice(*chunk_range(value.shape[0], dp, rank))]


class FlatGroup:
    """Parameters communicated together, with their offsets in a rank's shard of the group."""

    def __init__(self, params: list[nn.Parameter], dp: int, rank: int):
        self.params, self.dp, self.rank = params, dp, rank
        self.shapes = [p.shape for p in params]
        self.row_numel = [math.prod(s[1:]) for s in self.shapes]
        self.chunk_rows = [math.ceil(s[0] / dp) for s in self.shapes]
        self.chunk_numel = [r * n for r, n in zip(self.chunk_rows, self.row_numel)]
        self.offsets = [sum(self.chunk_numel[:i]) for i in range(len(params))]
        self.shard_numel = sum(self.chunk_numel)
        self.ranges = [chunk_range(s[0], dp, rank) for s in self.shapes]

    def local(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's own rows, as a view of this rank's (shard_numel,) shard of the group."""
        start, stop = self.ranges[i]
        n = (stop - start) * self.row_numel[i]
        return shard[self.offsets[i]:self.offsets[i] + n].view(stop - start, *self.shapes[i][1:])

    def pack(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, release=None) -> torch.Tensor:
        """Full tensors -> the (dp * shard_numel,) rank-ordered buffer; None and padding become zeros.
        `release(param)` is called as soon as a parameter's tensor is copied in (and the list lets it go)."""
        buffer = torch.empty(self.dp, self.shard_numel, dtype=dtype, device=self.params[0].device)
        for i, (shape, off, rows, n) in enumerate(zip(self.shapes, self.offsets, self.chunk_rows, self.chunk_numel)):
            t, tensors[i] = tensors[i], None
            if release is not None:
                release(self.params[i])
            region = buffer[:, off:off + n]
            if t is None:
                region.zero_()
                continue
            flat = t.reshape(shape[0], -1)
            padding = self.dp * rows - shape[0]
            if padding:
                flat = torch.cat([flat, flat.new_zeros(padding, flat.shape[1])])
            region.copy_(flat.view(self.dp, n))
        return buffer.view(-1)

    def pack_local(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's chunks -> its (shard_numel,) shard, zero-padded."""
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=tensors[0].device)
        for i, t in enumerate(tensors):
            self.local(shard, i).copy_(t)
        return shard

    def copy_full(self, gathered: torch.Tensor, i: int, out: torch.Tensor) -> None:
        """Parameter i from an all-gathered (dp * shard_numel,) buffer into `out` (its shape), rank chunk by
        rank chunk as strided copies: `full` would reshape the strided rows into a whole new copy first."""
        off, n, rows, chunk = self.offsets[i], self.chunk_numel[i], self.shapes[i][0], self.chunk_rows[i]
        src = gathered.view(self.dp, self.shard_numel)[:, off:off + n]
        dst = out.view(rows, -1)
        whole = rows // chunk  # ranks whose chunk is all rows; then at most one partial chunk, the rest padding
        dst[:whole * chunk].view(whole, n).copy_(src[:whole])
        if whole * chunk < rows:
            dst[whole * chunk:].view(-1).copy_(src[whole, :(rows - whole * chunk) * self.row_numel[i]])

    def full(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i, reassembled from an all-gathered (dp * shard_numel,) buffer."""
        off, n, shape = self.offsets[i], self.chunk_numel[i], self.shapes[i]
        rows = gathered.view(self.dp, self.shard_numel)[:, off:off + n].reshape(-1, *shape[1:])
        return rows[:shape[0]]


class Bucket:
    """One collective's worth of parameters (a size bucket, or under stage 3 a gather unit) and the
    state of its reduce-scatter, gradient shard and parameter shard."""

    def __init__(self, group: FlatGroup, unit: int):
        self.group, self.unit = group, unit
        self.ready = 0
        self.work = None
        self.output: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None  # fp32 sum of the reduced micro-batches
        self.folded = False  # this micro-batch's reduce-scatter is done and added to grad_shard
        self.shard: torch.Tensor | None = None  # stage 3: this rank's chunks of the parameters
        self.gathered = False
        # Stage 3 under fp8 all-gather: the parameters gathered in their dtype (`rest`, the shard's first
        # rest.shard_numel elements), and the float8 linears' weights (`fp8`, the rest of the shard), gathered
        # from `fp8_shard` (their rows cast to float8, as bytes) into their modules' `weight_float8` tensors.
        self.rest, self.fp8 = group, None
        self.fp8_shard: torch.Tensor | None = None
        self.fp8_modules: list[nn.Module] = []


class ZeroDataParallel(TimedWaits):
    """Sharded optimizer state (1), gradients (2) and parameters (3) for the optimizer's parameters.

    `params`: the parameters in optimizer order, with their `placements` (fivefold.parallel.placement).
    Stages 1-2: the parameters are materialised; `masters` are the fp32 masters of this rank's rows
    (`own_rows` of each initial value) under bf16-mixed, or None under fp32, where they are views of the
    parameters' rows. Stage 3: the parameters are still on the meta device, and `value_of(i)` gives
    parameter i's fp32 value one at a time: only this rank's rows of it are kept. The trainer drives
    it with `sync` (reduce on this micro-batch) and `finish()` after each reduced micro-batch; the
    optimizer reads `masters` and `local_grads()` and calls `publish()` after updating masters."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], stage: int, device_mesh, dp: int, rank: int,
                 device: torch.device, placements: list, masters: list[torch.Tensor] | None = None,
                 value_of=None, mixed: bool = False, grad_of=None, bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = 2**20, fp8_modules: dict | None = None, fp8_compiled: bool = False):
        """`fp8_modules` (stage 3): {weight: its Float8Linear} for the weights to gather as float8, cast
        by compiled kernels where `fp8_compiled` (fivefold.train.fp8.cast_weights)."""
        super().__init__()
        self.fp8_compiled = fp8_compiled
        self.model, self.params, self.stage, self.placements = model, list(params), stage, placements
        self.device_mesh, self.group = device_mesh, device_mesh.get_group()
        self.dp, self.rank, self.device = dp, rank, device
        self.grad_of = grad_of or (lambda p: p.grad)
        self.reduces_every_micro_batch = stage >= 2
        self.sync = True
        self.root_used_after_forward = False  # the loss reads the LM head's weight (train.loss_chunk)
        self._index = {p: i for i, p in enumerate(self.params)}
        fp8 = fp8_modules if stage == 3 and fp8_modules else {}
        if stage == 3:
            # float8-gathered weights last in their unit: the rest of the shard is then one prefix
            self.units = [[p for p in u if p not in fp8] + [p for p in u if p in fp8]
                          for u in _units(model, self.params)]
            groups = [FlatGroup(u, dp, rank) for u in self.units]
        else:
            buckets = size_buckets([p.numel() for p in self.params], bucket_bytes, first_bucket_bytes)
            groups = [FlatGroup([self.params[i] for i in b], dp, rank) for b in buckets]
        self.buckets = [Bucket(g, unit) for unit, g in enumerate(groups)]
        for b in self.buckets:
            weights = [p for p in b.group.params if p in fp8]
            if weights:
                b.rest = FlatGroup(b.group.params[:len(b.group.params) - len(weights)], dp, rank)
                b.fp8 = FlatGroup(weights, dp, rank)
                b.fp8_modules = [fp8[p] for p in weights]
        if self.reduces_every_micro_batch:  # persistent fp32 gradient shards, zeroed after each step
            for b in self.buckets:
                b.grad_shard = torch.zeros(b.group.shard_numel, dtype=torch.float32, device=device)
        self.slot = {}  # param -> (bucket, position in its group)
        for b in self.buckets:
            for j, p in enumerate(b.group.params):
                self.slot[p] = (b, j)
        self._gathers: dict[int, tuple] = {}
        self._publishing: list = []
        self._in_flight: list[Bucket] = []
        self.fp8_scales: torch.Tensor | None = None  # stage 3, fp8 all-gather: each float8 weight's scale
        if stage == 3:
            self.masters: list[torch.Tensor | None] = [None] * len(self.params)
            self._materialise_shards(value_of, mixed)
            self._cast_fp8()
        else:
            self.masters = list(masters) if masters is not None else \
                [own_rows(p.detach(), dp, rank) for p in self.params]

    def register_hooks(self) -> None:
        """Called once the optimizer exists: fp32 accumulation hooks, if any, must fold gradients first."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak(self._grad_ready))
        if self.stage == 3:  # weakly, as every hook here: the model must not keep this engine alive
            self.model.register_forward_pre_hook(weak(self._before_model_forward))
            self.model.register_forward_hook(weak(self._after_model_forward))
            for unit, block in enumerate(self.model.layers, start=1):
                block.register_forward_pre_hook(partial(weak(self._before_block), unit))
                block.register_forward_hook(partial(weak(self._after_block), unit))

    # -- gradients --------------------------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket, _ = self.slot[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.group.params):
            self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> None:
        if self.stage == 3:
            self._free(bucket.unit)  # its backward is done: the gathered weights go before the buffer comes
        flat = bucket.group.pack([self.grad_of(p) for p in bucket.group.params], torch.float32,
                                 release=_drop_grad)  # each .grad freed once its rows are in `flat` (2, 3)
        bucket.output = torch.empty(bucket.group.shard_numel, dtype=torch.float32, device=flat.device)
        bucket.work = reduce_scatter_into(bucket.output, flat, group=self.group, async_op=True)
        # Each reduce-scatter in flight holds its bucket's full fp32 gradients (and on gloo a full copy
        # of them). Backward can outrun the network, so without a bound every block's would queue up:
        # ~2x the planned memory at 20 blocks. Waiting for the oldest keeps one overlapping the next
        # block's backward, which is all the overlap there is to have.
        self._in_flight.append(bucket)
        while len(self._in_flight) > MAX_REDUCES_IN_FLIGHT:
            self._fold(self._in_flight.pop(0))

    def _fold(self, bucket: Bucket) -> None:
        """Wait for a bucket's reduce-scatter and add its result to the fp32 gradient shard."""
        self.wait(bucket.work)
        with torch.no_grad():
            if bucket.grad_shard is None:
                bucket.grad_shard = bucket.output
            else:
                bucket.grad_shard += bucket.output
        bucket.work, bucket.output, bucket.folded = None, None, True

    @torch.no_grad()
    def finish(self) -> None:
        """After a reduced micro-batch's backward: wait for its reduce-scatters, fold them into the fp32
        gradient shards."""
        for bucket in self.buckets:
            if bucket.work is None and not bucket.folded:
                self._reduce(bucket)  # parameters that got no gradient still take part, as zeros
        while self._in_flight:
            self._fold(self._in_flight.pop(0))
        for bucket in self.buckets:
            bucket.ready, bucket.folded = 0, False

    def local_grads(self) -> list[torch.Tensor | None]:
        """fp32 gradients of this rank's rows, aligned with `masters`; one reference each: the optimizer
        releases them as it goes."""
        out = []
        for p in self.params:
            bucket, j = self.slot[p]
            out.append(None if bucket.grad_shard is None else bucket.group.local(bucket.grad_shard, j))
        return out

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if self.reduces_every_micro_batch:
                bucket.grad_shard.zero_()
            else:
                bucket.grad_shard = None  # stage 1: the next step's reduce-scatter output replaces it

    def memory_roles(self) -> dict[str, list[torch.Tensor]]:
        """Tensors the memory tracker should count by role: the fp32 gradient shards (reduce-scatter
        buffers in flight are temporaries) and, under stage 3, the persistent parameter shards (the
        parameters gathered in full around a block's use are temporaries, as are the float8 all-gather's
        weights)."""
        roles = {"gradients": [b.grad_shard for b in self.buckets if b.grad_shard is not None]}
        if self.stage == 3:
            roles["parameters"] = [b.shard for b in self.buckets] + [b.fp8_shard for b in self.buckets
                                                                     if b.fp8 is not None]
            if self.fp8_scales is not None:
                roles["parameters"].append(self.fp8_scales)
        return roles

    def as_global(self, i: int, local: torch.Tensor):
        """This rank's rows of parameter i (or of a tensor shaped like its masters), placed in the full
        parameter: what torch.distributed.checkpoint saves and reshards."""
        placement = self.placements[i]
        start, _ = chunk_range(self.params[i].shape[0], self.dp, self.rank)
        offsets = placement.offsets
        return Piece(local, placement.global_shape, (offsets[0] + start, *offsets[1:]))

    # -- parameters after the optimizer step --------------------------------------------------------
    @torch.no_grad()
    def publish(self, indices: list[int]) -> None:
        """The masters at `indices` were updated: make the parameters follow (stage 3: the local chunks;
        stages 1-2: every rank's full parameters, by an all-gather that overlaps the next chunk's step)."""
        if self.stage == 3:
            for i in indices:
                bucket, j = self.slot[self.params[i]]
                local = bucket.group.local(bucket.shard, j)
                if local.data_ptr() != self.masters[i].data_ptr():
                    local.copy_(self.masters[i])
            return
        params = [self.params[i] for i in indices]
        group = FlatGroup(params, self.dp, self.rank)
        shard = group.pack_local([self.masters[i] for i in indices], params[0].dtype)
        gathered = torch.empty(self.dp * group.shard_numel, dtype=shard.dtype, device=shard.device)
        work = all_gather_into(gathered, shard, group=self.group, async_op=True)
        self._publishing.append((group, gathered, work))

    @torch.no_grad()
    def finish_publish(self) -> None:
        for group, gathered, work in self._publishing:
            self.wait(work)
            for i, p in enumerate(group.params):
                p.copy_(group.full(gathered, i))
        self._publishing = []
        self._cast_fp8()

    @torch.no_grad()
    def _cast_fp8(self) -> None:
        """Stage 3 under fp8 all-gather, after the parameters changed: each float8 weight's scale from the
        largest magnitude over every rank's rows (one all-reduce for all of them), and this rank's rows
        cast with it into the float8 shard."""
        if self.fp8_scales is None:
            return
        buckets = [b for b in self.buckets if b.fp8 is not None]
        rows = [b.fp8.local(b.shard[b.rest.shard_numel:], j) for b in buckets for j in range(len(b.fp8.params))]
        outs = [b.fp8.local(b.fp8_shard.view(WEIGHT_DTYPE), j) for b in buckets for j in range(len(b.fp8.params))]
        cast_weights(rows, outs, self.fp8_scales,
                     lambda amax: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group), self.fp8_compiled)

    # -- stage 3: parameters gathered around use --------------------------------------------------
    @torch.no_grad()
    def _materialise_shards(self, value_of, mixed: bool) -> None:
        """Fill one persistent shard per unit with this rank's rows of each parameter's value, taken one
        parameter at a time; the full parameters get storage of size zero (restored, and refilled, at
        every gather). Under fp32 the masters are the shard's own rows."""
        modules = [m for b in self.buckets for m in b.fp8_modules]
        if modules:
            self.fp8_scales = torch.ones(len(modules), dtype=torch.float32, device=self.device)
            for module, scale in zip(modules, self.fp8_scales):
                data = torch.empty(module.weight.shape, dtype=WEIGHT_DTYPE, device=self.device)
                data.untyped_storage().resize_(0)  # filled around each use, as the parameters are
                multiply_by_cast(module, data, scale)
        for unit, bucket in enumerate(self.buckets):
            params = bucket.group.params
            bucket.shard = torch.zeros(bucket.group.shard_numel, dtype=params[0].dtype, device=self.device)
            if bucket.fp8 is not None:
                bucket.fp8_shard = torch.zeros(bucket.fp8.shard_numel, dtype=torch.uint8, device=self.device)
            for j, p in enumerate(params):
                i = self._index[p]
                rows = value_of(i)[slice(*bucket.group.ranges[j])]
                local = bucket.group.local(bucket.shard, j)
                local.copy_(rows)
                self.masters[i] = rows.clone() if mixed else local
                del rows
                give_memory(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
                p.untyped_storage().resize_(0)
            bucket.gathered = False

    def _free(self, unit: int) -> None:
        bucket = self.buckets[unit]
        for p in bucket.rest.params:
            p.untyped_storage().resize_(0)
        for module in bucket.fp8_modules:
            module.weight_float8.untyped_storage().resize_(0)
        bucket.gathered = False

    def _gather(self, unit: int, wait: bool) -> None:
        """Start gathering `unit` unless it is gathered or on its way; with `wait`, complete it."""
        if unit >= len(self.buckets) or unit < 0:
            return
        bucket = self.buckets[unit]
        if not bucket.gathered and unit not in self._gathers:
            sources = [(bucket.rest, bucket.shard[:bucket.rest.shard_numel])]
            if bucket.fp8 is not None:
                sources.append((bucket.fp8, bucket.fp8_shard))
            started = []
            for group, shard in sources:
                if not group.shard_numel:
                    continue
                gathered = torch.empty(self.dp * group.shard_numel, dtype=shard.dtype, device=shard.device)
                started.append((group, gathered, all_gather_into(gathered, shard, group=self.group, async_op=True)))
            self._gathers[unit] = started
        if wait and unit in self._gathers:
            started = self._gathers.pop(unit)
            with torch.no_grad():
                for group, gathered, work in started:
                    self.wait(work)
                    if group is bucket.fp8:
                        for j, module in enumerate(bucket.fp8_modules):
                            data = module.weight_float8
                            data.untyped_storage().resize_(data.numel())
                            group.copy_full(gathered, j, data.data.view(torch.uint8))  # .data: as below
                        continue
                    for j, p in enumerate(group.params):
                        p.untyped_storage().resize_(p.numel() * p.element_size())
                        group.copy_full(gathered, j, p.data)  # via .data: autograd's saved views stay valid
            bucket.gathered = True

    def _before_block(self, unit: int, module, args) -> None:
        self._gather(unit, wait=True)
        if not in_backward():
            self._gather(unit + 1, wait=False)  # prefetch: the next block's gather overlaps this one

    def _after_block(self, unit: int, module, args, output):
        if in_backward():
            return output
        self._free(unit)
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(partial(weak(self._before_block_backward), unit))
        return output

    def _before_block_backward(self, unit: int, grad) -> None:
        self._gather(unit, wait=True)
        if unit > 1:
            self._gather(unit - 1, wait=False)

    def _before_model_forward(self, module, args):
        self._gather(0, wait=False)
        self._gather(1, wait=False)
        self._gather(0, wait=True)

    def _after_model_forward(self, module, args, output):
        if not (torch.is_grad_enabled() and output.requires_grad) and not self.root_used_after_forward:
            self._free(0)  # evaluation: no backward will need the root
        return output

    def release_root(self) -> None:
        """Free the root after an evaluation whose loss read it past the model's forward."""
        self._free(0)


def _units(model: nn.Module, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Stage 3's gather units: the root (everything outside the blocks), then each block in order."""
    in_blocks = [list(block.parameters()) for block in model.layers]
    owned = {p for block in in_blocks for p in block}
    wanted = set(params)
    return [[p for p in params if p not in owned]] + [[p for p in block if p in wanted] for block in in_blocks]


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None
