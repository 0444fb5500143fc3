"""Data-parallel step time: our Trainer (parallel.dp=N) against PyTorch's own data parallelism on the
same model, the same global batch and the same gloo process group.

--zero 0 (default): ours with BucketedAllReduce against DistributedDataParallel.
--zero 3: ours with parallel.zero=3 (parameters, gradients and optimizer state sharded) against FSDP2
(torch.distributed.fsdp.fully_shard on every block, then on the root).

    python bench/data_parallel.py --nproc 2 --json bench/results/data_parallel_dp2.json
    python bench/data_parallel.py --nproc 2 --bucket-mb 4            # several buckets: overlap possible
    python bench/data_parallel.py --nproc 2 --zero 3 --json bench/results/zero3_dp2.json
    torchrun --standalone --nproc-per-node 2 bench/data_parallel.py   # or launch the workers yourself

The script re-launches itself under torch.distributed.run with OMP_NUM_THREADS=--threads (default 1:
2 ranks on 2 cores). It checks that both sides compute the same first-step loss and gradient norm,
then times them in alternating windows (ours, reference, ours, reference, ...). Against DDP it then
splits our step into compute, flatten, wait and write-back to estimate how much of the all-reduce
backward hides; against FSDP2 it reports the share of our step spent blocked on collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

FIRST_STEP_RTOL = 1e-5  # same weights, batch and op order; only the reference's x world / world scaling differs


def common_args(description: str, grad_accum: int) -> argparse.ArgumentParser:
    """The options both multi-process benchmarks take."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads per rank")
    p.add_argument("--preset", default="demo", help="demo: 5.3M params, hidden 256, 4 layers, 8/4 heads")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=grad_accum, help="micro-batches per rank per step")
    p.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one is the check)")
    p.add_argument("--json", default="")
    return p


def parse_args(argv=None):
    p = common_args(__doc__, grad_accum=2)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="ours and DDP (parallel.bucket_mb default); FSDP2 communicates per fully_shard module")
    p.add_argument("--breakdown-rounds", type=int, default=10, help="rounds of our step's breakdown (--zero 0)")
    p.add_argument("--zero", type=int, choices=(0, 3), default=0,
                   help="0: ours against DDP; 3: ours with parallel.zero=3 against FSDP2")
    return p.parse_args(argv)


def launch(argv: list[str], args, script: str = __file__) -> int:
    """Re-run `script` (this file by default) in --nproc workers; OMP_NUM_THREADS must be set before torch
    starts in them."""
    from fivefold.parallel.launch import torchrun_args, without_option

    cmd = [sys.executable, "-m", "torch.distributed.run",
           *torchrun_args(args.nproc, [os.path.abspath(script), *without_option(argv, "--nproc")])]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}).returncode


def make_config(args, world: int, out_dir: str):
    from fivefold.config_load import load_config

    overrides = {"train.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
                 "train.grad_accum": args.grad_accum, "parallel.dp": world, "parallel.zero": args.zero,
                 "parallel.bucket_mb": args.bucket_mb,
                 "train.peak_flops": 1e11, "train.progress": False, "train.tensorboard": False,
                 "train.eval_every": 0, "train.steps": 10_000, "train.device": "cpu", "train.out_dir": out_dir}
    return load_config(preset=args.preset, overrides=[f"{k}={v}" for k, v in overrides.items()] + args.set)


class _TimedWork:
    """Stands in for the async all-reduce handle so that finish()'s wait is timed apart from its copies."""

    def __init__(self, work, sink: list):
        self.work, self.sink = work, sink

    def wait(self):
        start = time.perf_counter()
        self.work.wait()
        self.sink.append(time.perf_counter() - start)


class Ours:
    """Trainer.train_step. A ZeRO-3 reducer counts the seconds it has blocked on all-gathers and
    reduce-scatters (wait_seconds); each step's increment is kept to report the wait share of a step."""

    def __init__(self, cfg):
        from fivefold.train.trainer import Trainer

        self.trainer = Trainer(cfg, quiet=True)
        self.reducer = self.trainer.reducer
        self.step_wait_s = []

    def step(self) -> tuple[float, float]:
        before = getattr(self.reducer, "wait_seconds", None)
        record = self.trainer.train_step()
        if before is not None:
            self.step_wait_s.append(self.reducer.wait_seconds - before)
        return record["loss"], record["grad_norm"]


class OursTimedReducer(Ours):
    """With BucketedAllReduce's launch (flatten + issue) and finish (wait + write-back) timed: zero=0 only,
    since it patches that class's internals."""

    def __init__(self, cfg):
        super().__init__(cfg)
        reducer = self.reducer
        self.launch_s, self.finish_s, self.wait_s = [], [], []
        launch, finish = reducer._launch, reducer.finish

        def timed_launch(bucket):
            start = time.perf_counter()
            launch(bucket)
            self.launch_s.append(time.perf_counter() - start)
            bucket.work = _TimedWork(bucket.work, self.wait_s)

        def timed_finish():
            start = time.perf_counter()
            finish()
            self.finish_s.append(time.perf_counter() - start)

        reducer._launch, reducer.finish = timed_launch, timed_finish  # instance attributes: hooks see them


class TorchReference:
    """PyTorch's own recipe on the Trainer's initial weights (fp32): torch.optim.AdamW with our
    hyperparameters, implementation and no-decay groups, clipping at grad_clip, our lr schedule, and
    our batches through the same ResumableSampler. Each rank takes its contiguous slice of the global
    batch. DDP and FSDP2 both *average* gradients over ranks, so each rank's loss (sum / global tokens,
    our convention) is multiplied by the world size to get the same gradient as our SUM reduction.
    Subclasses wrap the model and choose which micro-batches communicate."""

    label = ""

    def __init__(self, cfg, data, mesh):
        from fivefold.data.dataset import ResumableSampler
        from fivefold.model import build_model
        from fivefold.memory.formulas import is_no_decay

        t = cfg.train
        model = build_model(cfg.model, "cpu", seed=t.seed, dtype=torch.float32)  # the Trainer's initial weights
        self.wrapped = self.wrap(model, cfg, mesh)
        # Read after wrapping: fully_shard replaces the parameters with DTensor shards.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if not is_no_decay(n)], "weight_decay": t.weight_decay},
                  {"params": [p for n, p in named if is_no_decay(n)], "weight_decay": 0.0}]
        impl = {"fused": True} if t.optimizer_impl == "fused" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **impl)
        self.params = [p for _, p in named]
        self.data, self.sampler = data.train, ResumableSampler(len(data.train), t.seed)  # our batches
        self.cfg, self.world, self.rank, self.steps_done = cfg, mesh.dp_size, mesh.dp_rank, 0

    def wrap(self, model, cfg, mesh):
        raise NotImplementedError

    def micro_batch_context(self, last: bool):
        """Entered around the forward and backward of each micro-batch."""
        return contextlib.nullcontext()

    def step(self) -> tuple[float, float]:
        from fivefold.data.labels import IGNORE_INDEX
        from fivefold.train.loss import token_loss_sum

        t = self.cfg.train
        batch = self.data.batch(self.sampler.take(t.micro_batch_size * t.grad_accum * self.world))
        inputs, labels = batch[:, :-1], batch[:, 1:]
        num_tokens = (labels != IGNORE_INDEX).sum()
        share = len(inputs) // self.world  # this rank's contiguous slice, as Trainer.local_rows
        mine = slice(self.rank * share, (self.rank + 1) * share)
        inputs, labels = inputs[mine], labels[mine]
        micro = torch.arange(share).split(t.micro_batch_size)
        loss = torch.zeros(())
        for i, mb in enumerate(micro):
            with self.micro_batch_context(last=i == len(micro) - 1):
                part = token_loss_sum(self.wrapped, inputs[mb], labels[mb], self.cfg) / num_tokens
                (part * self.world).backward()
            loss += part.detach()
        dist.all_reduce(loss)  # the global loss, as ours reports it (one tiny collective on both sides)
        return loss.item(), self.optimizer_step(batch[:, 1:].numel())

    def optimizer_step(self, batch_tokens: int) -> float:
        """Clip, set our schedule's lr, step AdamW, zero the gradients; returns the gradient norm."""
        from fivefold.train.optim import lr_at

        t = self.cfg.train
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip, foreach=True)
        if isinstance(norm, DTensor):  # sharded gradients give a norm that still needs its reduction
            norm = norm.full_tensor()
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.steps_done, t, batch_tokens, batch_tokens)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return norm.item()


class TorchDDP(TorchReference):
    """The textbook recipe: DDP(model) + AdamW(fused), no_sync() on all but the last micro-batch, clip 1.0."""

    label = "DDP"

    def wrap(self, model, cfg, mesh):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)

    def micro_batch_context(self, last: bool):
        return contextlib.nullcontext() if last else self.wrapped.no_sync()


class TorchFSDP2(TorchReference):
    """fully_shard on each block, then on the root (embedding, final norm, head), over our dp mesh.
    Defaults otherwise: blocks reshard after forward and all-gather again in backward; the root keeps
    its parameters unsharded from forward to backward.

    Every micro-batch reduce-scatters its gradients (FSDP2's default; no set_requires_gradient_sync(False)),
    because that is what our ZeRO-3 does: under ZeRO-2/3 a rank holds only its gradient shard. FSDP2's
    no-sync mode would instead keep full unsharded gradients across micro-batches, trading ZeRO-1 gradient
    memory for fewer collectives: not the same algorithm."""

    label = "FSDP2"

    def wrap(self, model, cfg, mesh):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh.grad_mesh)
        return fully_shard(model, mesh=mesh.grad_mesh)


def slowest(seconds: float, op=dist.ReduceOp.MAX) -> float:
    """A data-parallel step ends when its slowest rank does: the max over ranks."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def time_alternating(runners: dict, warmup: int, steps: int) -> tuple[dict, dict]:
    """One-step windows, ours then the reference, each between barriers, so outside load bursts hit both.
    Also per-step CPU use of this process / wall: above 1 is gloo's threads working beside compute."""
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    times, cpu = {k: [] for k in runners}, {k: [] for k in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            dist.barrier()
            start, c = time.perf_counter(), time.process_time()
            runner.step()
            wall = time.perf_counter() - start
            cpu[name].append((time.process_time() - c) / wall)
            times[name].append(slowest(wall))
    return times, cpu


def breakdown(ours: OursTimedReducer, rounds: int) -> dict:
    """Per round, on one batch: (a) forward+backward with the all-reduce (Trainer.accumulate_gradients),
    (b) the same forward+backward with reducer.sync=False and no finish(): compute only, (c) blocking
    all_reduce of buffers of our bucket sizes, one after another: the communication with nothing to hide
    behind. exposed = time in finish(); hidden = 1 - exposed / (c)."""
    tr, red = ours.trainer, ours.reducer
    keys = ("with_comm", "compute_only", "blocking_allreduce", "launch", "finish", "wait")
    out = {k: [] for k in keys}
    for _ in range(rounds):
        ours.launch_s.clear(), ours.finish_s.clear(), ours.wait_s.clear()
        inputs, labels = tr.global_batch(tr.cfg.train.grad_accum)
        dist.barrier()
        start = time.perf_counter()
        tr.accumulate_gradients(inputs, labels)
        out["with_comm"].append(slowest(time.perf_counter() - start))
        out["launch"].append(slowest(sum(ours.launch_s)))
        # A rank that finishes backward first also waits in finish() for its peer's backward: that is
        # load imbalance, not communication. The rank that arrives last waits for the wire only: MIN.
        out["finish"].append(slowest(sum(ours.finish_s), dist.ReduceOp.MIN))
        out["wait"].append(slowest(sum(ours.wait_s), dist.ReduceOp.MIN))
        tr.optimizer.zero_grad()
        red.zero_grad()

        mine = tr.local_rows(len(inputs))
        num_tokens = (labels != -100).sum()
        red.sync = False
        dist.barrier()
        start = time.perf_counter()
        for mb in torch.arange(len(inputs))[mine].split(tr.cfg.train.micro_batch_size):
            tr.forward_backward(inputs[mb], labels[mb], num_tokens)
        out["compute_only"].append(slowest(time.perf_counter() - start))
        red.sync = True
        tr.optimizer.zero_grad()

        buffers = [torch.zeros(sum(p.numel() for p in b.params)) for b in red.buckets]
        dist.barrier()
        start = time.perf_counter()
        for buf in buffers:
            dist.all_reduce(buf, group=tr.mesh.dp_group)
        out["blocking_allreduce"].append(slowest(time.perf_counter() - start))
    med = {k: statistics.median(v) for k, v in out.items()}
    # Everything the reducer adds to fwd+bwd (flatten, wait, write-back, CPU that gloo's threads take
    # from compute), paired within a round so that slow drift of the machine cancels.
    med["exposed_delta"] = statistics.median(a - b for a, b in zip(out["with_comm"], out["compute_only"]))
    med["hidden_fraction"] = 1 - med["finish"] / med["blocking_allreduce"]
    med["hidden_fraction_delta"] = 1 - med["exposed_delta"] / med["blocking_allreduce"]
    return {"median_s": med, "samples_s": out, "buckets": [b.nbytes for b in buffers]}


def machine_info(args, world: int) -> dict:
    from machine import base_info
    return {**base_info(), "ranks": world, "threads_per_rank": torch.get_num_threads(),
            "backend": dist.get_backend(), "oversubscribed": world * torch.get_num_threads() > (os.cpu_count() or 1)}


def first_step(ours: Ours, ref: TorchReference) -> dict:
    """The first step of each side, from the same weights and batch: loss and gradient norm must agree."""
    (lo, no), (lr, nr) = ours.step(), ref.step()
    key = ref.label.lower()
    check = {"loss_ours": lo, f"loss_{key}": lr, "loss_rel_diff": abs(lo - lr) / abs(lr),
             "grad_norm_ours": no, f"grad_norm_{key}": nr, "grad_norm_rel_diff": abs(no - nr) / abs(nr)}
    if dist.get_rank() == 0:
        print(f"first step: loss ours {lo:.7f} {ref.label} {lr:.7f} (rel {check['loss_rel_diff']:.1e}); grad norm "
              f"ours {no:.6f} {ref.label} {nr:.6f} (rel {check['grad_norm_rel_diff']:.1e})", flush=True)
    assert check["loss_rel_diff"] < FIRST_STEP_RTOL and check["grad_norm_rel_diff"] < 1e-4, check
    return check


def wait_shares(ours: Ours, step_times: list[float]) -> dict:
    """Our collective wait per timed step over that step's time. A rank that runs ahead also waits for its
    peer to reach the collective: load imbalance, not communication. The rank that waits least (MIN)
    bounds the communication from below; the one that waits most (MAX) from above."""
    waits = ours.step_wait_s[-len(step_times):]  # the timed steps came last
    out = {}
    for name, op in (("min_rank", dist.ReduceOp.MIN), ("max_rank", dist.ReduceOp.MAX)):
        out[name] = [slowest(w, op) / t for w, t in zip(waits, step_times)]
    return {"median": {k: statistics.median(v) for k, v in out.items()}, "samples": out}


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])
    cfg = make_config(args, world, tempfile.mkdtemp(prefix="fivefold-bench-dp-"))
    # The Trainer starts the gloo process group and the dp DeviceMesh (fivefold.parallel.mesh.init_mesh).
    ours = Ours(cfg) if args.zero else OursTimedReducer(cfg)
    ref = (TorchFSDP2 if args.zero else TorchDDP)(cfg, ours.trainer.data, ours.trainer.mesh)
    main = dist.get_rank() == 0
    check = first_step(ours, ref)
    key = ref.label.lower()

    times, cpu = time_alternating({"ours": ours, key: ref}, args.warmup - 1, args.steps)
    parts = None if args.zero else breakdown(ours, args.breakdown_rounds)
    waits = wait_shares(ours, times["ours"]) if args.zero and ours.step_wait_s else None
    if not main:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = cfg.global_batch_tokens
    params = sum(p.numel() for p in ref.params)  # the global count: a DTensor's numel is its full size
    if parts:
        try:  # for the record only: DDP's buckets as rebuilt after step 1 in gradient-ready order (private API)
            ref_buckets = [b.buffer().numel() * 4 for b in ref.wrapped.reducer._get_zeros_like_grad_buckets()]
        except Exception:
            ref_buckets = []
        layout = f"bucket {args.bucket_mb} MB: buckets ours {len(parts['buckets'])}, DDP {len(ref_buckets) or '?'}"
    else:
        layout = f"ZeRO-3 against FSDP2 ({cfg.model.num_layers} blocks + root)"
    print(f"\n{cfg.model.hidden_size}h x {cfg.model.num_layers}L ({params / 1e6:.2f}M params), {world} ranks x "
          f"{args.threads} thread, global batch {tokens} tokens, {layout}")
    print(f"{'impl':<5} | {'median ms':>9} | {'best ms':>7} | {'tokens/s':>8} | {'cpu/wall':>8}")
    for name in times:
        print(f"{name:<5} | {1e3 * med[name]:>9.1f} | {1e3 * min(times[name]):>7.1f} | {tokens / med[name]:>8.0f} | "
              f"{statistics.median(cpu[name]):>8.2f}")
    ratio, best_ratio = med["ours"] / med[key], min(times["ours"]) / min(times[key])
    print(f"ratio ours/{ref.label} (step time; target <= 1.0): median {ratio:.3f}, best {best_ratio:.3f}")
    if parts:
        m = parts["median_s"]
        print(f"ours, fwd+bwd of one step (median ms): with all-reduce {1e3 * m['with_comm']:.1f}, compute only "
              f"{1e3 * m['compute_only']:.1f}; flatten+issue {1e3 * m['launch']:.1f}, finish {1e3 * m['finish']:.1f} "
              f"(wait {1e3 * m['wait']:.1f}); blocking all-reduce alone {1e3 * m['blocking_allreduce']:.1f}; paired "
              f"with - without all-reduce {1e3 * m['exposed_delta']:.1f}")
        print(f"hidden fraction: {m['hidden_fraction']:.2f} (1 - finish / blocking all-reduce); "
              f"{m['hidden_fraction_delta']:.2f} counting every ms the reducer adds to fwd+bwd")
    if waits:
        w = waits["median"]
        print(f"ours, share of a step blocked on all-gather / reduce-scatter (reducer.wait_seconds): "
              f"{w['min_rank']:.3f} (rank waiting least) to {w['max_rank']:.3f} (most)")
    elif args.zero:
        print("ours: the reducer has no wait_seconds, so no wait share")
    if (os.cpu_count() or 1) < world * args.threads:
        print(f"note: {world} x {args.threads} threads on {os.cpu_count()} cores is oversubscribed")
    out = {"machine": machine_info(args, world), "first_step": check, "step_times_s": times, "cpu_per_wall": cpu,
           "median_step_s": med, "best_step_s": {k: min(v) for k, v in times.items()},
           f"ratio_ours_over_{key}": ratio, f"best_ratio_ours_over_{key}": best_ratio}
    if parts:
        out.update(ours_breakdown=parts, ddp_bucket_bytes=ref_buckets)
    else:
        out["ours_wait_share"] = waits
    out["settings"] = {**{k: v for k, v in vars(args).items() if k != "json"}, "world": world,
                       "global_batch_tokens": tokens, "params": params}
    write_json(args.json, out)


def write_json(path: str, out: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")


def main(parse, worker_fn, script: str) -> None:
    """Run as a torchrun worker, or re-launch `script` under torchrun."""
    parsed = parse()
    if "LOCAL_RANK" in os.environ:
        worker_fn(parsed)
        from fivefold.parallel.mesh import exit_worker

        exit_worker()
    else:
        sys.exit(launch(sys.argv[1:], parsed, script))


if __name__ == "__main__":
    main(parse_args, worker, __file__)
