"""AdamW over fp32 master weights, and the learning-rate and batch-size schedules.

Under bf16-mixed the model's parameters are bf16 (that is what forward and backward touch), and this
optimizer keeps the fp32 master copies and fp32 Adam moments: 2 + 2 + 12 bytes per parameter, the
ZeRO paper's accounting (Rajbhandari et al. 2020, section 3.1). With fp32 gradient accumulation each
bf16 gradient is folded into a persistent fp32 buffer as soon as autograd produces it (+4 bytes).
Under fp32 the masters *are* the parameters and nothing is copied.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adam import adam

from fivefold.checkpoint.pieces import Piece
from fivefold.config import TrainConfig
from fivefold.config_checks import parse_batch_schedule
from fivefold.memory.formulas import is_no_decay, joined_units, step_chunk_key
from fivefold.train.compiled_adamw import compiled_adamw


class MasterWeightAdamW:
    def __init__(self, model: nn.Module, cfg: TrainConfig, masters: list[torch.Tensor] | None = None,
                 gradients=None, sharding=None, tp_group=None, pp_group=None, ep_group=None, placements=None):
        """`masters`: the fp32 values of the (bf16) parameters, taken before they were rounded to bf16;
        without them the masters start from the rounded values. `gradients()`: the step's gradient of
        every parameter, handed over (default: each .grad, or the fp32 accumulation buffer); a
        data-parallel reducer supplies the reduced ones. `sharding`: a ZeRO engine
        (fivefold.parallel.zero) that owns the masters of this rank's rows and publishes updates.
        `placements` (fivefold.parallel.placement, by name): tensor-parallel shards count in the norm
        across `tp_group`, expert parameters across `ep_group`; `pp_group`: each pipeline stage holds
        different parameters, all of which count."""
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.placements = [placements[n] for n in self.names] if placements else None
        self.mixed = cfg.mixed  # bf16 parameters (bf16-mixed, fp8): fp32 masters here
        self.sharding, self.tp_group, self.pp_group, self.ep_group = sharding, tp_group, pp_group, ep_group
        self.syncs: list[tuple[int, object]] = []  # (parameter index, group summing its gradient)
        self.uncounted: set[int] = set()  # copies of a parameter counted elsewhere in the norm
        self._rows: dict[tuple[int, ...], list[torch.Tensor]] = {}  # local_squares' kind rows, by parameter set
        if sharding is not None:
            self.masters = list(sharding.masters)
        elif self.mixed:
            self.masters = masters if masters is not None else [p.detach().float().clone() for p in self.params]
        else:
            self.masters = list(self.params)
        self.main_grads = None
        self.grad_of = _dot_grad  # where a parameter's gradient accumulates: its fp32 buffer, or its .grad
        if cfg.fp32_grad_accum and (sharding is None or not sharding.reduces_every_micro_batch):
            # ZeRO-2/3 already accumulate every micro-batch's reduced gradients in fp32 shards.
            self.main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
            self.grad_of = dict(zip(self.params, self.main_grads)).__getitem__
            for p, buf in zip(self.params, self.main_grads):
                p.register_post_accumulate_grad_hook(_accumulate_into(buf))
        # A plain function or another object's method, never one of ours: a reference to ourselves
        # would be a cycle that keeps every tensor here alive until gc runs.
        self.gradient_source = gradients
        self.after_update: list = []  # called once the parameters hold new values (after a step, or a load)
        # AdamW's two groups, decayed and not; each parameter's decay, which the chunked update groups by
        decays = [not is_no_decay(n) for n in self.names]
        self.weight_decay = [cfg.weight_decay if d else 0.0 for d in decays]
        groups = [{"params": [m for m, d in zip(self.masters, decays) if d], "weight_decay": cfg.weight_decay},
                  {"params": [m for m, d in zip(self.masters, decays) if not d], "weight_decay": 0.0}]
        self.chunks = step_chunks(self.names, [m.numel() for m in self.masters], join=sharding is None)
        self.compiled = cfg.optimizer_impl == "compiled"  # one compiled kernel a tensor (no ZeRO: validated)
        self.fused = cfg.optimizer_impl == "fused"
        impl = {"fused": True} if self.fused or self.compiled else {"foreach": True}
        # Holds the moments and step counts (checkpoints read them through it); the update itself calls the
        # functional AdamW on each chunk's own parameters, where AdamW.step would walk every parameter of
        # both groups once per chunk to find the few with a gradient (bench/optimizer_host.py).
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)

    def _own_gradients(self) -> list[torch.Tensor | None]:
        if self.main_grads is not None:
            return list(self.main_grads)
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # from here on the step holds the only reference, released chunk by chunk
        return grads

    @torch.no_grad()
    def step(self, lr: float, grad_clip: float, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip by the global norm, then update chunk by chunk (embeddings, each block, the head).

        Stepping one chunk at a time bounds the step's temporaries (the fp32 copy of bf16 gradients,
        foreach AdamW's sqrt(exp_avg_sq)) by the largest chunk instead of the whole model, and frees each
        chunk's gradients as soon as it is updated. Returns the pre-clip gradient norm, on the device.

        A step whose gradient norm or `loss` is not finite changes nothing: not the masters, the moments or
        the step count. The fused AdamW is told so on the device (its found_inf, the input GradScaler uses),
        so this method never waits for the device: on a GPU the host queues the whole update while the
        backward still runs, and the update's launches (a few hundred for a small model's ~270 parameters,
        bench/optimizer_host.py) overlap the backward instead of following it. The foreach AdamW has no such
        input; it reads the verdict first. The compiled update (train.optimizer_impl=compiled) decides on the
        device as the fused one does."""
        grads = self.gradient_source() if self.gradient_source is not None else self._own_gradients()
        for i, group in self.syncs:
            if grads[i] is not None:
                import torch.distributed as dist

                dist.all_reduce(grads[i], group=group)
        norm = self._global_norm(grads)
        finite = torch.isfinite(norm) if loss is None else torch.isfinite(norm) & torch.isfinite(loss)
        found_inf = (~finite).float() if self.fused else ~finite if self.compiled else None
        if found_inf is None and not bool(finite):
            return norm
        coef = (grad_clip / (norm + 1e-6)).clamp(max=1.0) if grad_clip > 0 else None
        for group in self.inner.param_groups:
            group["lr"] = lr
        for chunk in self.chunks:
            self._step_chunk([i for i in chunk if grads[i] is not None], grads, coef, lr, found_inf)
        if self.sharding is not None:
            self.sharding.finish_publish()
        for hook in self.after_update:
            hook()
        return norm

    def _step_chunk(self, stepped: list[int], grads: list[torch.Tensor | None], coef: torch.Tensor | None,
                    lr: float, found_inf: torch.Tensor | None) -> None:
        """One chunk's update: the gradients at `stepped` in fp32 (taken out of `grads`, which lets them go),
        clipped by `coef`, AdamW by decay group, the parameters made to follow. A method of its own so that the
        chunk's fp32 copies are freed when it returns, before the next chunk makes its own (the plan's step peak
        holds one chunk's), and so that no master's .grad is set: the functional AdamW takes the list.
        Compiled, all of it is one kernel a tensor that reads the gradients as they are (no copies)."""
        if self.compiled:
            if stepped:
                self._compiled_step(stepped, grads, coef, lr, found_inf)
            return
        fp32 = _fp32_copies([grads[i] for i in stepped])
        for i in stepped:
            grads[i] = None
        if coef is not None:
            torch._foreach_mul_(fp32, coef)
        for decay in {self.weight_decay[i] for i in stepped}:  # AdamW's groups: decayed, not decayed
            picked = [k for k, i in enumerate(stepped) if self.weight_decay[i] == decay]
            self._adamw([self.masters[stepped[k]] for k in picked], [fp32[k] for k in picked], lr, decay, found_inf)
        if self.sharding is not None:
            self.sharding.publish(stepped)
        elif self.mixed and stepped:
            torch._foreach_copy_([self.params[i] for i in stepped], [self.masters[i] for i in stepped])

    def _compiled_step(self, stepped: list[int], grads: list[torch.Tensor | None], coef: torch.Tensor | None,
                       lr: float, skip: torch.Tensor) -> None:
        taken = [grads[i] for i in stepped]
        for i in stepped:
            grads[i] = None
        masters = [self.masters[i] for i in stepped]
        for m in masters:
            self.moment(m, "exp_avg")
        states = [self.inner.state[m] for m in masters]
        if coef is None:
            coef = torch.ones((), device=masters[0].device)
        beta1, beta2 = self.inner.defaults["betas"]
        compiled_adamw([self.params[i] for i in stepped], masters, taken, [s["exp_avg"] for s in states],
                       [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                       [self.weight_decay[i] for i in stepped], coef, skip, lr, beta1, beta2,
                       self.inner.defaults["eps"])

    def _adamw(self, masters: list[torch.Tensor], grads: list[torch.Tensor], lr: float, weight_decay: float,
               found_inf: torch.Tensor | None) -> None:
        """torch.optim.AdamW's update of `masters` by their fp32 `grads`, through the functional AdamW that
        AdamW.step calls, on the moments and step counts AdamW.step would use."""
        for m in masters:
            self.moment(m, "exp_avg")  # created at zero, as AdamW.step creates them, where this is the first step
        states = [self.inner.state[m] for m in masters]
        beta1, beta2 = self.inner.defaults["betas"]
        adam(masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [], [s["step"] for s in states], foreach=not self.fused, fused=self.fused, found_inf=found_inf,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=weight_decay, eps=self.inner.defaults["eps"], maximize=False)

    def _global_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        if self.sharding is None and self.tp_group is None and self.pp_group is None and self.ep_group is None:
            present = self._counted(grads)
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([grads[i] for i in present], 2,
                                                                            dtype=torch.float32)))
        return self.reduce_squares(self.local_squares(grads), zero_rows=True).sqrt()

    def _counted(self, grads: list[torch.Tensor | None]) -> list[int]:
        return [i for i, g in enumerate(grads) if g is not None and i not in self.uncounted]

    def local_squares(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's squared norms of `grads` (in parameter order, None: not counted), summed by what
        differs across ranks: (whole tensors, tensor-parallel shards, this rank's experts, both), fp32.
        The clipping norm is `reduce_squares` of these; so is the gradient noise scale's small-batch norm
        (fivefold.parallel.small_batch), taken at another moment of the step."""
        present = self._counted(grads)
        if not present:
            return torch.zeros(4, device=self.masters[0].device)
        norms = torch.stack(torch._foreach_norm([grads[i] for i in present], 2, dtype=torch.float32))
        squares = norms.square()
        return torch.stack([squares.index_select(0, rows).sum()
                            for rows in self._kind_rows(tuple(present), norms.device)])

    def _kind_rows(self, present: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
        """Positions in `present` of each kind (whole, tp, ep, tp and ep), on the device, made once per set of
        parameters: a step asks for the same sets every time (all, or a pipeline chunk's). Index lists, not
        boolean masks: selecting by a mask needs its count on the host, a wait for the device mid-step."""
        rows = self._rows.get(present)
        if rows is None:
            if len(self._rows) >= 16:  # sets that vary (experts no token reached): keep the cache bounded
                self._rows.clear()
            # kind: bit 0 = a tensor-parallel shard, bit 1 = an expert of this rank only
            kind = [self.placements[i].tp_sharded + 2 * self.placements[i].expert for i in present] \
                if self.placements else [0] * len(present)
            rows = self._rows[present] = [torch.tensor([j for j, k in enumerate(kind) if k == wanted],
                                                        dtype=torch.long, device=device) for wanted in range(4)]
        return rows

    def reduce_squares(self, parts: torch.Tensor, zero_rows: bool) -> torch.Tensor:
        """|g|^2 of the gradient whose local squares are `parts` (local_squares), summed over every rank
        that holds a different part of it. `zero_rows`: the gradients are ZeRO row shards (the reducer's),
        so the data-parallel ranks' parts add up too; False for full local gradients (before reduction)."""
        import torch.distributed as dist

        # Squares summed separately by what differs across ranks: tensor-parallel shards, this rank's
        # experts (each rank of the group holds a different part), both, or neither (whole tensors, the
        # same on every rank of those groups); ZeRO rows partition all of them across dp, pipeline
        # stages hold different parameters.
        if self.sharding is not None and zero_rows:
            dist.all_reduce(parts, group=self.sharding.group)
        if self.pp_group is not None:
            dist.all_reduce(parts, group=self.pp_group)
        if self.tp_group is not None:
            tp_parts = parts[1::2].clone()  # tp, tp and ep
            dist.all_reduce(tp_parts, group=self.tp_group)
            parts[1::2] = tp_parts
        if self.ep_group is not None:
            dist.all_reduce(parts[2:4], group=self.ep_group)
        return parts.sum()

    def sync_gradient(self, param: torch.Tensor, group, counted: bool) -> None:
        """Sum `param`'s gradient over `group` before each step (copies of one tied parameter on several
        ranks); `counted`: whether this copy counts in the gradient norm (exactly one should)."""
        i = next(k for k, p in enumerate(self.params) if p is param)
        self.syncs.append((i, group))
        if not counted:
            self.uncounted.add(i)

    def zero_grad(self) -> None:
        for p in self.params:  # (the masters never hold a .grad: each chunk's update takes its fp32 list)
            p.grad = None
        if self.main_grads is not None:
            for g in self.main_grads:
                g.zero_()

    # -- checkpointing -----------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """fp32 masters as "model.<name>" and Adam moments as "optim.<name>.exp_avg(_sq)": the tensors
        themselves (a load writes into them), as global DTensors when ZeRO shards them. Adam's step
        count, equal for all, is the trainer's step."""
        out = {}
        for i, (name, m) in enumerate(zip(self.names, self.masters)):
            for key, tensor in ((f"model.{name}", m), (f"optim.{name}.exp_avg", self.moment(m, "exp_avg")),
                                (f"optim.{name}.exp_avg_sq", self.moment(m, "exp_avg_sq"))):
                out[key] = self._placed(i, tensor)
        return out

    def _placed(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter i's full tensor, with where it sits (ZeRO rows and/or a
        tensor-parallel shard), or the tensor itself when every rank holds all of it."""
        if self.sharding is not None:
            return self.sharding.as_global(i, tensor)
        placement = self.placements[i] if self.placements else None
        if placement is None or not placement.sharded:
            return tensor
        return Piece(tensor, placement.global_shape, placement.offsets)

    def moment(self, master: torch.Tensor, key: str) -> torch.Tensor:
        """An Adam moment, created (zero, at step 0) before the first step so a checkpoint can load into it."""
        state = self.inner.state[master]
        if not state:
            state.update(step=self._step_tensor(0, master), exp_avg=torch.zeros_like(master),
                         exp_avg_sq=torch.zeros_like(master))
        return state[key]

    def _step_tensor(self, step: int, master: torch.Tensor) -> torch.Tensor:
        # As torch.optim.AdamW keeps it: a float32 scalar, on the parameter's device when fused.
        device = master.device if self.inner.defaults.get("fused") else "cpu"
        return torch.tensor(float(step), dtype=torch.float32, device=device)

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        """Masters and moments were loaded in place: set Adam's step count, make the parameters follow."""
        for m in self.masters:
            self.moment(m, "exp_avg")
            self.inner.state[m]["step"] = self._step_tensor(step, m)
        if self.sharding is not None:
            self.sharding.publish(list(range(len(self.masters))))
            self.sharding.finish_publish()
        elif self.mixed:
            torch._foreach_copy_(list(self.params), self.masters)
        for hook in self.after_update:
            hook()


def step_chunks(names: list[str], numels: list[int], join: bool) -> list[list[int]]:
    """Indices of parameters grouped by the unit they are stepped with (one block, or a top-level module),
    with `join` neighbouring units taken together up to the largest unit's size (formulas.joined_units)."""
    chunks: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        chunks.setdefault(step_chunk_key(name), []).append(i)
    units = list(chunks.values())
    if not join:
        return units
    return [[i for j in group for i in units[j]]
            for group in joined_units([sum(numels[i] for i in unit) for unit in units])]


def _fp32_copies(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads` in fp32: the fp32 ones themselves, the others copied into one buffer by one foreach copy (a
    chunk's bf16 gradients: a multi-tensor kernel or a few, where a cast each took a launch each, 272 for
    smollm2-135m)."""
    low = [g for g in grads if g.dtype != torch.float32]
    if not low:
        return grads
    flat = torch.empty(sum(g.numel() for g in low), dtype=torch.float32, device=low[0].device)
    copies = [view.view(g.shape) for view, g in zip(flat.split([g.numel() for g in low]), low)]
    torch._foreach_copy_(copies, low)
    made = iter(copies)
    return [g if g.dtype == torch.float32 else next(made) for g in grads]


def _dot_grad(p: nn.Parameter) -> torch.Tensor | None:
    return p.grad


def _accumulate_into(buffer: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        buffer.add_(param.grad)  # bf16 -> fp32 add: accumulation across micro-batches happens in fp32
        param.grad = None
    return hook


# ---------------------------------------------------------------------------------------------------
# Schedules


def lr_at(step: int, cfg: TrainConfig, batch_tokens: int, base_batch_tokens: int) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup, then the decay shape, times the
    batch-size scaling rule (linear: Goyal et al. 2017; square root: Krizhevsky 2014, Malladi et al. 2022)."""
    peak = cfg.lr * _batch_scale(cfg.lr_scaling, batch_tokens, base_batch_tokens)
    floor = peak * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    total = max(cfg.steps, cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return peak
    if cfg.lr_schedule == "wsd":  # warmup-stable-decay (Hu et al. 2024, MiniCPM): flat, then linear decay
        decay_start = max(cfg.warmup_steps, int(total * (1 - cfg.decay_fraction)))
        if step < decay_start:
            return peak
        frac = (step - decay_start) / max(1, total - decay_start)
        return peak - (peak - floor) * min(1.0, frac)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return peak - (peak - floor) * frac
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def _batch_scale(rule: str, batch_tokens: int, base_tokens: int) -> float:
    ratio = batch_tokens / base_tokens
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def grad_accum_at(tokens_seen: int, cfg: TrainConfig) -> int:
    """Gradient-accumulation steps in force after `tokens_seen` tokens (the batch-size schedule)."""
    accum = cfg.grad_accum
    for threshold, value in parse_batch_schedule(cfg.batch_schedule):
        if tokens_seen >= threshold:
            accum = value
    return accum

