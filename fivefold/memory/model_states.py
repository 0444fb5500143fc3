"""The model states of one rank, as the plan reads them off its parameter list: the inventory (sizes by
part, the optimizer's step units), the gradients at their peak, the data-parallel reduction's buffers and
the start-up peak while the rank builds its part (fivefold.memory.plan puts them together)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fivefold.config import Config, ModelConfig
from fivefold.memory import formulas
from fivefold.model.moe import is_stacked_expert
from fivefold.parallel.data_parallel import size_buckets
from fivefold.parallel.zero import MAX_REDUCES_IN_FLIGHT


@dataclass(frozen=True)
class Inventory:
    """What the plan reads from a rank's parameter list (memoised: the layout search plans the same
    stages thousands of times)."""
    n: int
    largest: int
    units: tuple[tuple[int, int], ...]  # (decayed, not decayed) numels of each optimizer step unit
    joined: tuple[tuple[int, int], ...]  # the same of the units an unsharded step takes together
    largest_shared: int  # the largest parameter in a step unit of several (ZeRO-1/2 reassemble it on publish)
    root: int  # outside the blocks: embeddings, final norm, LM head
    blocks: tuple[int, ...]  # each block's
    head: int  # the LM head's
    mlp: int  # the blocks' feed-forward layers' (a mixture of experts: router, this rank's experts, shared)
    after_core: int  # the blocks' MLP norms' and attention output projections' (their adapters' with LoRA)
    final_norm: int
    experts: int  # the stacked expert weights'


@functools.lru_cache(maxsize=1024)
def inventory(shapes: tuple[tuple[str, int], ...]) -> Inventory:
    units: dict[str, list[int]] = {}
    blocks: dict[str, int] = {}
    members: dict[str, list[int]] = {}
    for name, numel in shapes:
        key = formulas.step_chunk_key(name)
        units.setdefault(key, [0, 0])[formulas.is_no_decay(name)] += numel
        members.setdefault(key, []).append(numel)
        if key.startswith("layers."):
            blocks[key] = blocks.get(key, 0) + numel
    n = sum(numel for _, numel in shapes)
    sizes = list(units.values())
    joined = tuple((sum(sizes[j][0] for j in group), sum(sizes[j][1] for j in group))
                   for group in formulas.joined_units([sum(size) for size in sizes]))
    return Inventory(n=n, largest=max(numel for _, numel in shapes), units=tuple(map(tuple, sizes)), joined=joined,
                      largest_shared=max((max(m) for m in members.values() if len(m) > 1), default=0),
                      root=n - sum(blocks.values()), blocks=tuple(blocks.values()),
                      head=sum(numel for name, numel in shapes if name.startswith("lm_head.")),
                      mlp=sum(numel for name, numel in shapes if ".mlp." in name),
                      after_core=sum(numel for name, numel in shapes
                                     if ".attn.o_proj." in name or ".mlp_norm." in name),
                      final_norm=sum(numel for name, numel in shapes if name.startswith("norm.")),
                      experts=sum(numel for name, numel in shapes if is_stacked_expert(name)))


@functools.lru_cache(maxsize=1024)
def bucket_sums(numels: tuple[int, ...], bucket_bytes: int) -> tuple[int, ...]:
    """Numels of each data-parallel gradient bucket (fivefold.parallel.data_parallel.size_buckets)."""
    return tuple(sum(numels[i] for i in b) for b in size_buckets(list(numels), bucket_bytes))


def gradients(cfg: Config, shapes: tuple, inv: Inventory, bpp) -> float:
    """Peak gradient memory. One process: every .grad (or the fp32 accumulation buffers plus the one
    bf16 .grad being folded in). Data (or context) parallel (fivefold.parallel): the reduction over dp x cp
    is in fp32 and its
    result is what the optimizer reads, so ZeRO-0 ends backward with 4 bytes per parameter and ZeRO-1
    with 4 per parameter of its shard, beside the full gradients held until the last micro-batch's
    reduction. ZeRO-2/3 keep persistent fp32 gradient shards, plus the full gradients of the bucket
    (ZeRO-2) or gather unit (ZeRO-3: a block, or the embeddings + head root) still being filled."""
    t, par = cfg.train, cfg.parallel
    n = inv.n
    full = bpp.gradients * n
    if t.fp32_grad_accum:
        full = bpp.main_gradients * n + bpp.gradients * inv.largest
    if par.grad_size == 1:
        return full
    shard = math.ceil(n / par.grad_size)
    if par.zero <= 1:
        reduced = 4 * (n if par.zero == 0 else shard)
        if par.zero == 0 and par.ep == par.grad_size:
            # Every rank holds other experts: their gradients are not reduced, so the optimizer reads them
            # where backward left them (the .grad, or the fp32 accumulation buffer).
            reduced -= (4 if t.fp32_grad_accum else 4 - bpp.gradients) * inv.experts
        # fp32 buffers stay beside the reduced gradients; the bf16 .grad being folded in is gone by then.
        return bpp.main_gradients * n + reduced if t.fp32_grad_accum else max(full, reduced)
    if par.zero == 2:
        filling = max(bucket_sums(tuple(numel for _, numel in shapes), int(par.bucket_mb * 2**20)))
    else:
        filling = max(inv.root, inv.head + max(inv.blocks, default=0))
    return 4 * shard + bpp.gradients * filling


def reductions(cfg: Config, inv: Inventory, shapes: tuple, grad_bytes: float,
                accumulated: float, kept: float = 0.0) -> tuple[float, float]:
    """(gradients + reduction buffers, reduction buffers) at their largest while a reduced micro-batch's
    backward hands its gradients to the data-parallel reducer (fivefold.parallel.zero: _reduce / _fold;
    without ZeRO fivefold.parallel.data_parallel, whose MoE expert handling is not replayed), unit by
    unit in launch order: ZeRO-1/2's size buckets (last layers first), ZeRO-3's blocks from the last,
    then the root. Packing a unit allocates its fp32 buffer while its .grads (`grad_bytes` per
    parameter) are still there (or, under ZeRO-1 with accumulation, every .grad not packed yet:
    `accumulated` bytes), then releases them; `kept`: buffers that stay throughout (ZeRO-1's fp32
    accumulation buffers). Each reduce-scatter in flight holds that buffer and its fp32 output shard
    (gloo's copy of the input, made on its own thread while it runs, is left out: see plan_memory's
    notes). After a launch at most MAX_REDUCES_IN_FLIGHT stay: the oldest is folded into the gradient
    shards, which ZeRO-2/3 keep from step to step and ZeRO-1 builds from the outputs."""
    par = cfg.parallel
    g = par.grad_size
    if g == 1 or (par.zero == 0 and par.ep > 1):
        return 0.0, 0.0
    # Without ZeRO (fivefold.parallel.data_parallel) each bucket's buffer is all-reduced in place and
    # becomes the reduced gradients the optimizer reads: none is released before the step.
    keep_all = par.zero == 0
    if par.zero == 3:
        order = [*reversed(inv.blocks), inv.root]
    else:
        order = list(bucket_sums(tuple(numel for _, numel in shapes), int(par.bucket_mb * 2**20)))
    shards = kept + (4 * math.ceil(inv.n / g) if par.zero >= 2 else 0.0)
    pending, flight, total, temporary = accumulated, [], 0.0, 0.0
    for u in order:
        grads, flat, out = grad_bytes * u, 4 * u, 0 if keep_all else 4 * math.ceil(u / g)
        # DDP's bucket is concatenated from fp32 copies of bf16 .grads (ZeRO packs them in place).
        staging = 4 * u if keep_all and grad_bytes not in (0, 4) else 0
        earlier = sum(f + o for f, o in flight)
        total = max(total, shards + (pending or grads) + flat + staging + earlier)
        pending = max(0.0, pending - grads)
        flight.append((flat, out))
        total = max(total, shards + pending + earlier + flat + out)
        temporary = max(temporary, flat + staging + out + earlier)
        while not keep_all and len(flight) > MAX_REDUCES_IN_FLIGHT:
            _, out = flight.pop(0)
            if par.zero == 1:
                shards += out
    return total, temporary


def startup(cfg: Config, shapes: list[tuple[str, int]], parameters: float, shard, n: int,
             lora: bool, cast: float) -> float:
    """Peak while a rank builds its part (fivefold.train.parallelize): the model is split on the meta
    device, then each local parameter is materialised from its full fp32 initial value, one at a time.
    Held at the end: the parameters, the fp32 masters (bf16-mixed; Adam's moments only come with the
    first step), and the gradient buffers made up front (fp32 accumulation buffers; ZeRO-2/3's fp32
    gradient shards), which except under ZeRO-3 are made once every parameter is. Beside them, what the
    parameter being made adds beyond what the rank keeps of it (_being_made), as if the largest were made
    last: a bound, reached when it is. `n`: the parameters that train (all, or LoRA's adapters;
    `lora`: the base is frozen); `cast`: the first cast of fp8's weights cast once a step, after the rest
    is made."""
    t, par = cfg.train, cfg.parallel
    masters = 4 * shard(n, 1) if t.mixed else 0.0
    grad_buffers = 0.0
    g = par.grad_size
    if g > 1 and par.zero >= 2:
        grad_buffers = 4 * shard(n, 2)
    elif t.fp32_grad_accum:
        grad_buffers = 4 * n
    kept = (2 if t.mixed else 4, 1 / g if par.zero >= 3 and g > 1 else 1.0,  # the parameter: dtype, share
            4 if t.mixed else 0, 1 / g if par.zero >= 1 and g > 1 else 1.0)  # its fp32 master: bytes, share
    made = _being_made(tuple(shapes), cfg.model, par.tp, kept, lora)
    if par.zero < 3 or g == 1:  # the buffers come after the parameters (the optimizer's, ZeRO's)
        return parameters + masters + max(made, grad_buffers + cast)
    return parameters + masters + grad_buffers + max(made, cast)  # ZeRO-3 makes its parameters inside its engine



def _being_made(shapes: tuple, model, tp: int, kept: tuple, lora: bool) -> float:
    """Bytes the parameter being made holds beyond what the rank keeps of it, for the largest case
    among this rank's parameters. initial_value draws the full fp32 value and scales it (randn, then
    the product: two full fp32 tensors at once, 8 bytes per element of the whole parameter); the rank
    keeps its slice as the parameter (in its dtype; under ZeRO-3 its rows) and, for a parameter that
    trains under bf16-mixed, as its fp32 master (under ZeRO its rows). A frozen bf16 parameter (LoRA's
    base) thus leaves 6 bytes per element on top of itself, a trained fp32 one 4. A stacked expert
    weight is drawn one expert's full matrix (plus its slice) at a time, 4 bytes per element of each."""
    return _being_made_cached(shapes, tuple(vars(model).items()), tp, kept, lora)


@functools.lru_cache(maxsize=1024)
def _being_made_cached(shapes: tuple, model_fields: tuple, tp: int, kept: tuple, lora: bool) -> float:
    model = ModelConfig(**dict(model_fields))
    param_bytes, param_share, master_bytes, master_share = kept
    matrix = model.hidden_size * model.expert_size
    stacked = [4 * (numel + matrix + (matrix // tp if tp > 1 else 0)) for name, numel in shapes
               if is_stacked_expert(name)]
    layers = sorted({int(name.split(".")[1]) for name, _ in shapes if name.startswith("layers.")})
    names = {name for name, _ in shapes}
    full = dict(formulas.parameter_shapes(model, 1, layers, "embed_tokens.weight" in names,
                                          "norm.weight" in names))  # global sizes of this rank's parameters
    # (a tied model's last pipeline stage holds a copy of the embedding as lm_head.weight)
    full.setdefault("lm_head.weight", model.vocab_size * model.hidden_size)

    def beyond(numel: int, whole: int) -> float:
        master = 0.0 if lora else master_bytes * master_share * numel  # the base is frozen under LoRA
        return 8 * whole - param_bytes * param_share * numel - master

    return max([beyond(numel, full[name]) for name, numel in shapes
                if name in full and not is_stacked_expert(name)] + stacked)
