"""Measured memory of real training steps, by category, op by op.

A TorchDispatchMode sees every tensor an op returns; each new storage is recorded with its size and
a weak reference, so its release (the weakref callback) is seen too, as in PyTorch's own
torch.distributed._tools.mem_tracker.MemTracker. After every op the live storages are summed by
category:

  parameters        the model's parameters (under fp32 they are also the optimizer's masters)
  gradients         the parameters' .grad and the fp32 main-gradient buffers
  optimizer_states  Adam's exp_avg / exp_avg_sq / step, and the fp32 master weights under bf16-mixed
  activations       tensors allocated during forward (model and loss), or during backward while
                    torch.utils.checkpoint recomputes a region (grad mode on, or inside its saved-tensor
                    hooks: an autograd.Function's forward runs with grad mode off)
  temporary         everything else: gradients of activations, optimizer-step intermediates, the
                    fp32 copies of bf16 gradients made for the optimizer step, the batch

The categories of parameters, gradients and optimizer states are decided by identity at each sample
(a storage becomes a gradient when autograd stores it in .grad); the others by when they were
allocated. On CUDA the caching allocator's own count (torch.cuda.memory_allocated) is sampled too,
and `cuda_history` records torch.cuda.memory's allocation history for the snapshot viewer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import tempfile
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fivefold.config import Config
from fivefold.memory import host
from fivefold.memory.plan import plan_memory
from fivefold.memory.units import CATEGORIES
from fivefold.parallel.mesh import local_device, resolve_device
from fivefold.train.trainer import Trainer



class MemoryTracker(TorchDispatchMode):
    """Live bytes per category after every op; `marks` label where forward/backward/step begin."""

    def __init__(self, model: torch.nn.Module, optimizer=None, reducer=None):
        """`reducer`: a data-parallel gradient reducer (fivefold.parallel), whose buffers hold the reduced
        gradients and, under ZeRO-3, the parameter shards."""
        super().__init__()
        self.model, self.optimizer, self.reducer = model, optimizer, reducer
        self.live = WeakIdKeyDictionary()  # untyped storage -> [nbytes, tag, weakref with a free callback]
        self.by_tag = dict.fromkeys(CATEGORIES, 0)  # live bytes by allocation tag
        self._tensor_info: dict[int, tuple] = {}
        self._static, self._states = None, (0, [])
        self.samples: list[tuple[float, ...]] = []  # one row per op: CATEGORIES..., device_allocated
        self.marks: list[tuple[int, str]] = []
        self.phase = "idle"  # "forward" from the model's forward until backward starts
        # QLoRA's int4 codes (fivefold.finetune.qlora) are buffers, but they are the frozen weights; fp8's
        # weights cast once a step (fivefold.train.fp8.WeightCast) are attributes, kept as they are.
        cast = [t for m in model.modules() for t in (getattr(m, "weight_float8", None),
                                                      getattr(m, "weight_float8_scale", None)) if t is not None]
        self.params = [*model.parameters(), *(b for n, b in model.named_buffers()
                                              if n.rsplit(".", 1)[-1] in ("qweight", "scales", "zeros")), *cast]
        self.cuda = any(p.is_cuda for p in self.params)
        self._hooks = []

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self):
        # The model's forward, or, for a pipeline stage that runs only some blocks, any block's, and the
        # first stage's embedding, which it calls before its first block.
        embed = getattr(self.model, "embed_tokens", None)
        modules = [self.model, *(b for b in getattr(self.model, "layers", []) if hasattr(b, "attn")),
                   *([embed] if embed is not None else [])]
        self._hooks = [m.register_forward_pre_hook(self._on_forward) for m in modules]
        for b in self.model.buffers():
            self._track(b, "temporary")
        if "parameters" in self._roles():
            # ZeRO-3: the reducer's shards are the parameters; the model's own parameter storages (and the
            # float8 all-gather's weights) are empty except while gathered, which is transient.
            for p in self.params:
                self._track(p, "temporary")
        self.sample()  # registers parameters, masters, main gradients and any optimizer state
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self.sample()
        return super().__exit__(*exc)

    def mark(self, label: str) -> None:
        self.marks.append((len(self.samples), label))
        if label in ("optimizer step", "zero_grad"):
            self.phase = "step" if label == "optimizer step" else "idle"

    def _on_forward(self, module, args):
        if self.phase != "forward" and torch._C._current_graph_task_id() == -1:
            self.phase = "forward"
            self.mark("forward")

    # -- classification ----------------------------------------------------------------------------
    def _moves(self, tensors, role: str) -> list[tuple[str, str, int]]:
        """(allocation tag, role, bytes) for each distinct storage of `tensors`."""
        out, seen = [], set()
        for t in tensors:
            info = self._info(t)
            if info is not None and id(info) not in seen:
                seen.add(id(info))
                out.append((info[1], role, info[0]))
        return out

    def _role_moves(self) -> list[tuple[str, str, int]]:
        """Storages whose category is known by identity: parameters, fp32 masters and main gradients
        (fixed), Adam states (fixed once created), and each parameter's current .grad."""
        opt = self.optimizer
        roles = self._roles()
        if self._static is None:
            self._static = self._moves(self.params, "parameters") if "parameters" not in roles else []
            if opt is not None:
                self._static += self._moves(opt.masters if opt.mixed else (), "optimizer_states")
                self._static += self._moves(opt.main_grads or (), "gradients")
        if opt is not None:
            count = sum(map(len, opt.inner.state.values()))
            if count != self._states[0]:
                tensors = [v for st in opt.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
                self._states = (count, self._moves(tensors, "optimizer_states"))
        grads = self._moves((p.grad for p in self.params if p.grad is not None), "gradients")
        dynamic = [move for role in ("parameters", "gradients") for move in self._moves(roles.get(role, ()), role)]
        return self._static + self._states[1] + grads + dynamic

    def _roles(self) -> dict:
        return self.reducer.memory_roles() if self.reducer is not None else {}

    def _track(self, t: torch.Tensor, tag: str):
        if t.device.type == "meta":
            return None
        st = t.untyped_storage()
        info = self.live.get(st)
        if info is None:  # a new storage: count it under its tag until the weakref says it is freed
            info = [st.nbytes(), tag, None]
            info[2] = weakref.ref(st, partial(self._freed, info))
            self.by_tag[tag] += info[0]
            self.live[st] = info
        return info

    def _freed(self, info: list, ref) -> None:
        self.by_tag[info[1]] -= info[0]

    def _resync(self) -> None:
        """Storages resized in place (ZeRO-3 parameters, SP's re-gathered inputs are released and
        refilled with untyped_storage().resize_, which no op dispatch shows): count their size now."""
        for st, info in self.live.items():
            nbytes = st.nbytes()
            if nbytes != info[0]:
                self.by_tag[info[1]] += nbytes - info[0]
                info[0] = nbytes

    def _info(self, t: torch.Tensor):
        """_track(t), memoised per tensor object (validated by a weak reference, so nothing is kept alive)."""
        entry = self._tensor_info.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        info = self._track(t, "temporary")
        self._tensor_info[id(t)] = (weakref.ref(t), info)
        return info

    def sample(self) -> None:
        """Append one row: bytes per category now. Running totals by allocation tag, corrected for
        the few storages whose role (parameter, gradient, optimizer state) is known by identity."""
        self._resync()
        totals = dict(self.by_tag)
        for tag, role, nbytes in self._role_moves():
            totals[tag] -= nbytes
            totals[role] += nbytes
        device = torch.cuda.memory_allocated() if self.cuda else 0
        self.samples.append(tuple(totals[c] for c in CATEGORIES) + (device,))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrapper = next((type(t) for t in tree_leaves((args, kwargs)) if is_traceable_wrapper_subclass(t)), None)
        if wrapper is not None:
            # A wrapper tensor subclass (torchao's float8 tensors under train.precision=fp8) runs the op as
            # plain ops on its inner tensors: run its __torch_dispatch__ with this mode active, so that
            # those ops, where the memory is, are tracked. Its own outputs own no memory of their own (their
            # "storage" is a placeholder sized as if they were plain): not counted.
            TorchDispatchMode.__enter__(self)  # the mode only, not this tracker's hooks and samples
            try:
                return wrapper.__torch_dispatch__(func, types, args, kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        out = func(*args, **kwargs)
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self.phase == "forward":
            self.phase = "backward"
            self.mark("backward")
        elif not in_backward and self.phase == "backward":
            self.phase = "idle"
        if in_backward:
            # Checkpoint recomputation runs forward ops with grad mode on, and an autograd.Function's forward
            # in it (a float8 linear's casts and product) with grad mode off but still inside the
            # recomputation's saved-tensor hooks, which nothing else in backward sets.
            recomputing = (torch.is_grad_enabled()
                           or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            tag = "activations" if recomputing else "temporary"
        elif self.phase == "step" and func is torch.ops.aten.zeros_like.default:
            # Adam creates its states in its first step, each an op before it enters the state dict (where
            # identity would classify it): count it as what it is from the start.
            tag = "optimizer_states"
        else:
            tag = "activations" if self.phase == "forward" else "temporary"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                self._track(t, tag)
        self.sample()
        return out


# ---------------------------------------------------------------------------------------------------


@dataclass
class MemoryTimeline:
    """Bytes per category after every op of the first steps, with the planner's prediction beside it."""
    samples: list[tuple[float, ...]]
    marks: list[tuple[int, str]]
    steps: int
    device: str
    predicted: dict | None = None  # plan_memory(...).memory for the same config and device
    config: dict = field(default_factory=dict)
    startup: float | None = None  # peak bytes while the Trainer was built (CUDA: allocator; CPU: tensors)
    startup_rss: float | None = None  # CPU: the resident set's growth over the same time (StartupPeak)

    def series(self, category: str) -> list[float]:
        return [row[CATEGORIES.index(category)] for row in self.samples]

    @property
    def peaks(self) -> dict[str, float]:
        peaks = {c: max(self.series(c), default=0) for c in CATEGORIES}
        peaks["total"] = max((sum(row[:len(CATEGORIES)]) for row in self.samples), default=0)
        if self.device == "cuda":
            peaks["device_allocated"] = max(row[-1] for row in self.samples)
        if self.startup is not None:
            peaks["startup"] = self.startup
        if self.startup_rss is not None:
            peaks["startup_rss"] = self.startup_rss
        return peaks

    def comparison(self) -> list[tuple[str, float, float, float]]:
        """(category, predicted, measured peak, relative error) per category and for the total."""
        rows = []
        for name, measured in self.peaks.items():
            if self.predicted is None or name not in self.predicted:
                continue
            predicted = self.predicted[name]
            error = (predicted - measured) / measured if measured else 0.0
            rows.append((name, predicted, measured, error))
        return rows

    def to_json(self) -> dict:
        return {"steps": self.steps, "device": self.device, "peaks": self.peaks, "predicted": self.predicted,
                "comparison": [dict(zip(("category", "predicted", "measured", "error"), r))
                               for r in self.comparison()],
                "marks": self.marks, "categories": list(CATEGORIES), "samples": self.samples}

    def table(self) -> str:
        lines = [f"{'category':18s} {'predicted':>14s} {'measured peak':>14s} {'error':>8s}"]
        for name, predicted, measured, error in self.comparison():
            lines.append(f"{name:18s} {predicted:>14,.0f} {measured:>14,.0f} {100 * error:>+7.2f}%")
        if self.steps < 2 and self.predicted and "total" in self.predicted:
            # AdamW makes its moments in the first optimizer step, after that step's forward and backward:
            # one step never holds them beside activations, as every later step (the plan's total) does.
            lines.append("note: the total is planned for every step after the first, which holds the optimizer "
                         "states through forward and backward; measure 2 or more steps to compare it")
        if self.startup_rss is not None:
            lines.append(f"{'startup (RSS)':18s} {'':>14s} {self.startup_rss:>14,.0f}  resident set's growth")
        return "\n".join(lines)

    def dumps(self) -> str:
        return json.dumps(self.to_json())


class StartupPeak:
    """The memory a block of code adds at its peak: on CUDA the caching allocator's high-water mark;
    on CPU the process's resident set (fivefold.memory.host), which also counts what no tensor owns (malloc
    arenas, communication buffers). Run with MALLOC_MMAP_THRESHOLD_=1048576 so glibc returns freed large
    blocks and the resident set follows live memory. Where the system cannot restart the resident set's
    high-water mark (not Linux), a block that stays below the process's earlier peak has no peak of its
    own to read: `bytes` is then None rather than the earlier peak's."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = torch.device(device), None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            host.return_freed_memory()
            self.base = host.resident()
            self.reset = host.reset_resident_peak()
            self.earlier_peak = host.resident_peak()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
            return
        peak = host.resident_peak()
        if self.reset or peak > self.earlier_peak:
            self.bytes = max(0, peak - self.base)


class RandomTokens:
    """Uniform random token windows: memory does not depend on token values (unless the document
    mask is on, where only eos positions matter), so tests and quick measurements skip the corpus."""

    def __init__(self, vocab_size: int, seq_len: int, items: int = 4096, seed: int = 0):
        self.vocab_size, self.seq_len, self.items, self.seed = vocab_size, seq_len, items, seed

    def __len__(self) -> int:
        return self.items

    def batch(self, indices) -> torch.Tensor:
        rows = [torch.randint(0, self.vocab_size, (self.seq_len + 1,),
                              generator=torch.Generator().manual_seed(self.seed * 1_000_003 + i)) for i in indices]
        return torch.stack(rows)

    def pairs(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.batch(indices)
        return rows[:, :-1], rows[:, 1:]


@dataclass
class _Datasets:
    train: RandomTokens
    val: RandomTokens


def random_datasets(cfg: Config) -> _Datasets:
    return _Datasets(RandomTokens(cfg.model.vocab_size, cfg.train.seq_len),
                     RandomTokens(cfg.model.vocab_size, cfg.train.seq_len, items=64, seed=1))


def measure_memory(cfg: Config, steps: int = 4, datasets=None, cuda_history: str | None = None) -> MemoryTimeline:
    """Run the first `steps` real training steps of `cfg` with the Trainer and record memory by category
    after every op. `datasets` defaults to the config's data; pass random_datasets(cfg) to skip it.
    `cuda_history`: a path for torch.cuda.memory's snapshot (open it at pytorch.org/memory_viz)."""
    cfg = copy.deepcopy(cfg)
    cfg.train.peak_flops = cfg.train.peak_flops or 1.0  # MFU is irrelevant here: skip the matmul benchmark
    cfg.train.tensorboard = False
    with tempfile.TemporaryDirectory() as out_dir:
        local = local_device(resolve_device(cfg.train.device))
        made = MemoryTracker(torch.nn.Module()) if local.type != "cuda" else contextlib.nullcontext()
        with StartupPeak(local) as startup, made:
            trainer = Trainer(cfg, out_dir=out_dir, quiet=True, datasets=datasets)
        # On CUDA the allocator's high-water mark counts tensors only; on CPU the resident set also counts
        # what no tensor owns (code pages first touched, allocator arenas, gloo's buffers), megabytes that
        # swamp a small model's part: the tensors made while the Trainer was built are compared with the
        # plan there, and the resident set's growth is reported beside them.
        startup_rss = None
        if local.type != "cuda":
            startup_rss = startup.bytes
            startup.bytes = max((sum(row[:len(CATEGORIES)]) for row in made.samples), default=0)
        device, stage = trainer.device.type, trainer.mesh.pp_rank
        if cuda_history and device == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        tracker = MemoryTracker(trainer.model, trainer.optimizer, trainer.reducer)
        optimizer = trainer.optimizer
        step, zero_grad = optimizer.step, optimizer.zero_grad

        def marked_step(*args, **kwargs):
            tracker.mark("optimizer step")
            return step(*args, **kwargs)

        def marked_zero_grad():
            tracker.mark("zero_grad")
            return zero_grad()

        optimizer.step, optimizer.zero_grad = marked_step, marked_zero_grad  # this trainer instance only
        try:
            with tracker:
                for i in range(steps):
                    tracker.mark(f"step {i + 1}")
                    trainer.train_step()
        finally:
            optimizer.step, optimizer.zero_grad = step, zero_grad
            if cuda_history and device == "cuda":
                torch.cuda.memory._dump_snapshot(cuda_history)
                torch.cuda.memory._record_memory_history(enabled=None)
    plan = plan_memory(cfg, device=device)
    # A pipeline rank is compared with its own stage's plan (plan.memory is the most loaded stage's).
    predicted = plan.stages[stage].memory if cfg.parallel.pp > 1 else plan.memory
    return MemoryTimeline(samples=tracker.samples, marks=tracker.marks, steps=steps, device=device,
                          predicted=predicted, config=dataclasses.asdict(cfg), startup=startup.bytes,
                          startup_rss=startup_rss)
