"""Pipeline parallelism: the model's blocks partitioned into stages, micro-batches streamed through them
by an explicit per-rank action list (fivefold.parallel.pipeline_schedules).

The pipeline's micro-batches are the step's gradient-accumulation micro-batches, so the global batch and
the loss convention are unchanged. Stage `chunk * pp + rank` holds a contiguous range of blocks; the first
also the embeddings, the last the final norm, the LM head and the loss. With tied embeddings the last
stage keeps its own copy of the shared matrix (still named embed_tokens.weight), and the two copies'
gradients are summed before every optimizer step, so they stay equal.

Activations and their gradients move by point-to-point isend/irecv, batched per action with
dist.batch_isend_irecv: the receive an action needs, together with the sends the previous action made.
Sends never block, and every schedule is a valid dependency order, so no rank can wait on a rank that
waits on it. Zero-bubble's W passes come from linears whose weight gradient is deferred: backward (B)
stashes (input, output gradient) and W computes the weight gradient from them.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.memory.formulas import partition
from fivefold.model import ForwardContext
from fivefold.model.moe import MoE
from fivefold.parallel.pipeline_schedules import build_schedule, stage_of


class _DeferredWeightLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns the input and bias gradients only, and leaves the weight
    gradient for a later W pass (zero-bubble)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash, owner):
        # `weight` is owner.weight detached, and the owner module is no tensor argument: autograd must not
        # reach the parameter's gradient accumulator here (it would run, and fire the data-parallel hooks,
        # with nothing to accumulate).
        ctx.save_for_backward(x, weight)
        ctx.stash, ctx.owner, ctx.has_bias = stash, owner, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.stash.defer(ctx.owner.weight, x, grad)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad @ weight, None, grad_bias, None, None


class WeightGradStash:
    """Deferred weight-gradient work, by (micro-batch, chunk)."""

    def __init__(self):
        self.key = None
        self.work: dict[tuple[int, int], list] = {}

    def defer(self, weight, x, grad) -> None:
        self.work.setdefault(self.key, []).append((weight, x, grad))

    def run(self, key) -> None:
        for weight, x, grad in self.work.pop(key, []):
            grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
            # Through autograd, so that accumulation into .grad and its hooks (data parallel) happen as usual.
            torch.autograd.backward([weight], [grad_weight])


class _DeferredLinear(nn.Module):
    def __init__(self, linear: nn.Linear, stash: WeightGradStash):
        super().__init__()
        self.weight, self.bias, self.stash = linear.weight, linear.bias, stash

    def forward(self, x):
        if not x.requires_grad:  # nothing upstream trains (a LoRA adapter on a frozen embedding's output):
            return F.linear(x, self.weight, self.bias)  # a detached weight would leave no backward at all
        return _DeferredWeightLinear.apply(x, self.weight.detach(), self.bias, self.stash, self)


class Pipeline:
    """This rank's stages of `model` (pruned in place) and the executor of its action list."""

    def __init__(self, model: nn.Module, cfg, mesh, dtype: torch.dtype, reducer_of=lambda: None,
                 context_of=lambda ids: ForwardContext(), router_loss_of=None):
        par = cfg.parallel
        self.model, self.cfg, self.dtype, self.reducer_of = model, cfg, dtype, reducer_of
        self.context_of = context_of  # the ForwardContext of a micro-batch's tokens (positions, documents)
        # A mixture of experts' router losses join the backward of the chunk whose layers made them.
        self.router_loss_of = router_loss_of
        self.pp, self.rank, self.v = par.pp, mesh.pp_rank, par.pp_virtual_stages
        self.group, self.ranks = mesh.pp_group, dist.get_process_group_ranks(mesh.pp_group)
        self.num_stages = self.pp * self.v
        ranges = partition(cfg.model.num_layers, self.num_stages, par.pp_layers)
        self.chunks = [ranges[stage_of(self.rank, c, self.pp)] for c in range(self.v)]
        self.first = self.rank == 0  # holds stage 0 (chunk 0)
        self.last = self.rank == self.pp - 1  # holds the last stage (chunk v-1)
        self.tied = cfg.model.tie_embeddings
        self._prune()
        self.moe = [[m for i in chunk for m in model.layers[i].modules() if isinstance(m, MoE)]
                    for chunk in self.chunks]
        self.stash = WeightGradStash()
        if par.pp_schedule == "zero-bubble":
            for i in self._own_layers():
                for module in list(model.layers[i].modules()):
                    for name, child in list(module.named_children()):
                        if type(child) is nn.Linear and child.weight.requires_grad:  # not a frozen base
                            setattr(module, name, _DeferredLinear(child, self.stash))
        self._schedules: dict[int, list] = {}
        self.timeline: list = []
        self._waited = 0.0

    def _own_layers(self) -> list[int]:
        return [i for chunk in self.chunks for i in chunk]

    def _prune(self) -> None:
        """Drop what other stages hold (their memory is freed; parameter names stay global)."""
        model, own = self.model, set(self._own_layers())
        for i in range(len(model.layers)):
            if i not in own:
                model.layers[i] = nn.Identity()
        if not self.first:
            if not (self.last and self.tied):  # the last stage's copy of a tied matrix keeps its name
                model.embed_tokens = None
            if hasattr(model, "embed_positions"):
                model.embed_positions = None
        if not self.last:
            model.norm, model.lm_head = None, None
        elif self.tied and not self.first:
            # Untie from the first stage's copy: a parameter of this stage, named embed_tokens.weight.
            model.lm_head.weight = model.embed_tokens.weight

    def chunk_of(self, name: str) -> int:
        """The chunk (of this rank's) holding parameter `name`: its block's, the first stage's for the
        embeddings, the last stage's for the final norm and head."""
        parts = name.split(".")
        if parts[0] == "layers":
            layer = int(parts[1])
            return next(c for c, layers in enumerate(self.chunks) if layer in layers)
        return 0 if parts[0].startswith("embed") else self.v - 1

    def tied_parameter(self) -> nn.Parameter | None:
        """The shared embedding/head matrix when this rank holds one of its two copies."""
        if self.tied and self.pp > 1 and (self.first or self.last):
            return self.model.embed_tokens.weight
        return None

    # -- one training step ---------------------------------------------------------------------------
    def schedule(self, m: int) -> list:
        return self.schedules(m)[self.rank]

    def schedules(self, m: int) -> list[list]:
        """Every rank's action list (a rank's sends are released by what its peers' lists imply)."""
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.cfg.parallel.pp_schedule, self.pp, m, self.v)
        return self._schedules[m]

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor, loss_fn,
                   after: dict[int, Callable[[], None]] | None = None):
        """Forward and backward of every micro-batch of (N, S) inputs; returns this rank's summed loss
        (non-zero on the last stage only). `loss_fn(logits, labels)` is the summed token loss. `after`:
        {index in this rank's action list: called once that action is done} (fivefold.parallel.small_batch
        reads micro-batch 0's gradient there)."""
        micro = self.cfg.train.micro_batch_size
        batches = list(zip(inputs.split(micro), labels.split(micro)))
        m = len(batches)
        held: dict[tuple[int, int], tuple] = {}
        sends: list = []  # made by the previous action: batched with the next action's receive
        pending = _InFlightSends(self.schedules(m), self.pp)
        loss_sum = torch.zeros((), device=inputs.device)
        reducer = self.reducer_of()
        self.timeline = []  # (action, start, end) in seconds from the step's start: the measured picture
        step_start = time.perf_counter()
        for index, action in enumerate(self.schedule(m)):
            start = time.perf_counter() - step_start
            stage = stage_of(self.rank, action.chunk, self.pp)
            receives = (action.kind == "F" and stage > 0) or (action.kind == "B" and stage < self.num_stages - 1)
            if not receives:  # nothing to batch the previous action's sends with: they go now
                self._flush(sends, pending)
            if reducer is not None:
                reducer.sync = action.mb == m - 1 or reducer.reduces_every_micro_batch
            if action.kind == "F":
                ids, lab = batches[action.mb]
                x = ids if stage == 0 else self._receive(sends, pending, "F", action.mb, stage - 1, ids)
                out = self.forward_chunk(action.chunk, x, ids)
                aux = self.router_loss_of(self.moe[action.chunk]) if self.router_loss_of else None
                if stage == self.num_stages - 1:
                    out = loss_fn(out, lab) / num_tokens
                    loss_sum += out.detach()
                else:
                    sends.append((out.detach(), "F", action.mb, stage, stage + 1))
                held[(action.mb, action.chunk)] = (x, out, aux)
            elif action.kind == "B":
                x, out, aux = held.pop((action.mb, action.chunk))
                self.stash.key = (action.mb, action.chunk)
                if stage == self.num_stages - 1:
                    (out if aux is None else out + aux).backward()
                else:
                    grad = self._receive(sends, pending, "B", action.mb, stage + 1, out)
                    if aux is None:
                        torch.autograd.backward(out, grad)
                    else:
                        torch.autograd.backward([out, aux], [grad, torch.ones_like(aux)])
                if stage > 0:
                    sends.append((x.grad, "B", action.mb, stage, stage - 1))
                # The micro-batch's output and the gradient received for it are spent: not kept alive by
                # these names through the next action's forward.
                x = out = aux = grad = None
            else:
                self.stash.run((action.mb, action.chunk))
            # Waiting for a receive counts as idle: the action starts when its input is here.
            self.timeline.append((action, start + self._waited, time.perf_counter() - step_start))
            self._waited = 0.0
            if after and index in after:
                after[index]()
        self._flush(sends, pending)
        pending.wait_all()
        return loss_sum

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn) -> torch.Tensor:
        """Summed token loss of (N, S) inputs, micro-batch by micro-batch through every stage in turn
        (evaluation); non-zero on the last stage only."""
        total = torch.zeros((), device=inputs.device)
        micro = self.cfg.train.micro_batch_size
        for mb, (ids, lab) in enumerate(zip(inputs.split(micro), labels.split(micro))):
            x = ids
            for chunk in range(self.v):
                stage = stage_of(self.rank, chunk, self.pp)
                if stage > 0:
                    x = self._receive([], None, "E", mb, stage - 1, ids)
                out = self.forward_chunk(chunk, x, ids)
                if stage == self.num_stages - 1:
                    total += loss_fn(out, lab)
                else:
                    for work in dist.batch_isend_irecv(self._ops([(out, "E", mb, stage, stage + 1)])):
                        work.wait()
        return total

    # -- pieces ----------------------------------------------------------------------------------------
    def forward_chunk(self, chunk: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The blocks of one chunk; the embeddings before them on stage 0, the head after on the last."""
        model, stage = self.model, stage_of(self.rank, chunk, self.pp)
        ctx = self.context_of(ids)
        positions = model.positions(ids, ctx)
        if stage == 0:
            x = model.embed(ids, positions)
        rope, mask = model.context(ids, positions, ctx, self.dtype)
        for i in self.chunks[chunk]:
            x = model.layers[i](x, rope, mask)
        return model.head(x) if stage == self.num_stages - 1 else x

    def activation_shape(self, ids: torch.Tensor) -> tuple[int, ...]:
        seq = ids.shape[1]
        if self.cfg.parallel.sequence_parallel and self.cfg.parallel.tp > 1:
            seq //= self.cfg.parallel.tp
        return (ids.shape[0], seq, self.cfg.model.hidden_size)

    def _peer(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    def _tag(self, kind: str, mb: int, stage: int) -> int:
        return (("FBE".index(kind) * 4096 + mb) * self.num_stages + stage) % (2**31 - 1)

    def _receive(self, sends: list, pending: "_InFlightSends | None", kind: str, mb: int, from_stage: int,
                 like: torch.Tensor):
        """Receive (batched with the sends waiting to go) the activation or gradient `from_stage` sent.
        `pending` tracks a training step's sends; evaluation (None) sends nothing alongside."""
        shape = self.activation_shape(like) if kind != "B" else like.shape
        buffer = torch.empty(shape, dtype=self.dtype, device=like.device)
        recv = dist.P2POp(dist.irecv, buffer, self._peer(from_stage), tag=self._tag(kind, mb, from_stage))
        works = dist.batch_isend_irecv([*self._ops(sends), recv])
        if sends:
            pending.add(works[:-1], sends)
        start = time.perf_counter()
        works[-1].wait()
        self._waited += time.perf_counter() - start
        sends.clear()
        if pending is not None:
            pending.received(kind, mb, from_stage)
        return buffer.requires_grad_(kind == "F")

    def _flush(self, sends: list, pending: "_InFlightSends") -> None:
        if sends:
            pending.add(dist.batch_isend_irecv(self._ops(sends)), sends)
        sends.clear()

    def _ops(self, sends: list) -> list:
        """(tensor, kind, mb, from_stage, to_stage) sends as P2P operations."""
        return [dist.P2POp(dist.isend, t.contiguous(), self._peer(to), tag=self._tag(kind, mb, frm))
                for t, kind, mb, frm, to in sends]


class _InFlightSends:
    """Sends not yet known to have arrived. A send keeps its tensor (an activation or its gradient) until
    it is waited on; waiting at the end of the step would keep all m of them. A peer's list says when a
    send has surely arrived: the peer ran the action consuming it before the action whose output just
    reached us, so waiting on it then returns at once and frees the tensor. (Waiting earlier, on a send
    the peer has not taken yet, could deadlock two ranks that both wait on their sends to each other.)"""

    def __init__(self, lists: list[list], pp: int):
        self.pp = pp
        self.index = [{(a.kind, a.mb, a.chunk): i for i, a in enumerate(actions)} for actions in lists]
        self.works: list[tuple[int, int, object]] = []  # (peer rank, index of the consuming action, work)

    def _at(self, kind: str, mb: int, stage: int) -> tuple[int, int]:
        """(rank, position in its list) of the action `kind` of micro-batch mb at `stage`."""
        rank = stage % self.pp
        return rank, self.index[rank][(kind, mb, stage // self.pp)]

    def add(self, works: list, sends: list) -> None:
        for work, (_, kind, mb, _, to) in zip(works, sends):
            self.works.append((*self._at("B" if kind == "B" else "F", mb, to), work))

    def received(self, kind: str, mb: int, from_stage: int) -> None:
        peer, produced_at = self._at(kind, mb, from_stage)
        still = []
        for rank, consumed_at, work in self.works:
            if rank == peer and consumed_at < produced_at:
                work.wait()
            else:
                still.append((rank, consumed_at, work))
        self.works = still

    def wait_all(self) -> None:
        for *_, work in self.works:
            work.wait()
        self.works = []


def tied_group(mesh, pp: int):
    """Process groups joining each first-stage rank with the last-stage rank of the same (dp, tp)
    coordinates; returns this rank's (None when it holds neither end). Every rank creates every group,
    in the same order, as torch.distributed requires."""
    mine = None
    layout = mesh.device_mesh.mesh.flatten(1)  # (pp, dp x cp x tp) global ranks
    for column in range(layout.shape[1]):
        ranks = [int(layout[0, column]), int(layout[pp - 1, column])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
