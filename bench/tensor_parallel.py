"""Tensor-parallel step time: our Trainer (parallel.tp=N, dp=1) against PyTorch's DTensor tensor
parallelism (torch.distributed.tensor.parallel) on the same model, the same batches and the same gloo
process group; plus the bytes our tensor parallelism moves per step, measured against the formula.

    python bench/tensor_parallel.py --nproc 2 --json bench/results/tensor_parallel_tp2.json
    python bench/tensor_parallel.py --nproc 2 --sp --json bench/results/tensor_parallel_tp2_sp.json
    torchrun --standalone --nproc-per-node 2 bench/tensor_parallel.py   # or launch the workers yourself

Ours: Trainer.train_step() with parallel.tp=--nproc (+ parallel.sequence_parallel=true with --sp): column-
and row-parallel linears, vocabulary-parallel embedding, and a vocabulary-parallel cross-entropy on logits
that stay sharded. Reference: fivefold.model.build_model (the Trainer's initial weights, unsharded) through
parallelize_module over a 1-D DeviceMesh of the tp ranks: ColwiseParallel q/k/v/gate/up, RowwiseParallel
o/down, RowwiseParallel(input_layouts=Replicate()) embedding, ColwiseParallel(output_layouts=Shard(-1),
use_local_output=False) LM head and F.cross_entropy under loss_parallel(); with --sp, SequenceParallel
norms and Shard(1) boundaries as in PyTorch's TP tutorial. Its optimizer is bench/data_parallel.py's
TorchReference recipe (torch.optim.AdamW, same hyperparameters and no-decay groups, clip_grad_norm_).

The script re-launches itself under torch.distributed.run with OMP_NUM_THREADS=--threads (default 1), checks
both sides' first-step loss and gradient norm, times them in alternating one-step windows, and counts the
collectives of one step of each side.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from data_parallel import (Ours, TorchReference, common_args, first_step, machine_info, main, time_alternating,
                           write_json)


def parse_args(argv=None):
    p = common_args(__doc__, grad_accum=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    return p.parse_args(argv)


def make_config(args, world: int, out_dir: str):
    from fivefold.config_load import load_config

    overrides = {"train.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
                 "train.grad_accum": args.grad_accum, "parallel.dp": 1, "parallel.tp": world,
                 "parallel.sequence_parallel": str(args.sp).lower(), "train.precision": "fp32",
                 "train.peak_flops": 1e11, "train.progress": False, "train.tensorboard": False,
                 "train.eval_every": 0, "train.steps": 10_000, "train.device": "cpu", "train.out_dir": out_dir}
    return load_config(preset=args.preset, overrides=[f"{k}={v}" for k, v in overrides.items()] + args.set)


# -- the reference -------------------------------------------------------------------------------------


def tp_plan(model, sequence_parallel: bool) -> tuple[dict, dict]:
    """parallelize_module plans: (per block, root). Without SP the residual stream and the norms stay
    replicated plain tensors; with SP they are sharded along the sequence (Shard(1)), the norms run as
    SequenceParallel and the attention / MLP inputs are all-gathered once each by PrepareModuleInput."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    # q/k/v, gate/up return local tensors (use_local_output=True): the attention's view(b, s, -1, head_dim)
    # then sees this rank's heads, and o/down take those local tensors as Shard(-1) inputs.
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    block = {"attn.o_proj": row, "mlp.down_proj": row}
    block.update({f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
    mlp = model.layers[0].mlp
    block.update({f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj") if hasattr(mlp, name)})
    if sequence_parallel:
        block.update({
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            # Attention.forward(x, rope, mask, kv_cache): only x is a tensor to gather.
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
        root = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    else:
        root = {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return block, root


class TorchTP(TorchReference):
    """DTensor tensor parallelism + TorchReference's optimizer recipe. Every tp rank holds the whole batch
    and computes the whole loss, so unlike data parallelism nothing is scaled by the world size and the
    loss is not all-reduced; the loss and its backward run under loss_parallel(), on sharded logits."""

    label = "DTensor"

    def wrap(self, model, cfg, mesh):
        from torch.distributed.tensor.parallel import parallelize_module

        if cfg.model.position != "rope":
            raise SystemExit("the DTensor reference covers RoPE models (learned positions would need their own "
                             "SP layout)")
        tp_mesh = mesh.device_mesh["tp"]
        tied = model.lm_head.weight is model.embed_tokens.weight
        block_plan, root_plan = tp_plan(model, cfg.parallel.sequence_parallel)
        for block in model.layers:
            parallelize_module(block, tp_mesh, block_plan)
        parallelize_module(model, tp_mesh, root_plan)
        if tied:  # both weights are (vocab, hidden) sharded Shard(0) over the same mesh: share one DTensor
            model.lm_head.weight = model.embed_tokens.weight
        return model

    def micro_batch_context(self, last: bool):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def step(self) -> tuple[float, float]:
        from torch.distributed.tensor.experimental import implicit_replication

        from fivefold.data.labels import IGNORE_INDEX
        from fivefold.train.loss import token_loss_sum

        t = self.cfg.train
        batch = self.data.batch(self.sampler.take(t.micro_batch_size * t.grad_accum))  # the same on all tp ranks
        inputs, labels = batch[:, :-1], batch[:, 1:]
        num_tokens = (labels != IGNORE_INDEX).sum()
        loss = torch.zeros(())
        micro = torch.arange(len(inputs)).split(t.micro_batch_size)
        for i, mb in enumerate(micro):
            with self.micro_batch_context(last=i == len(micro) - 1):
                part = token_loss_sum(self.wrapped, inputs[mb], labels[mb], self.cfg) / num_tokens
                part.backward()
            loss += part.detach().to_local()  # a Replicate DTensor: every rank holds the whole value
        # Without SP the norm gains stay plain tensors beside the DTensor shards; implicit_replication lets
        # the foreach norm and AdamW treat them as Replicate.
        with implicit_replication():
            return loss.item(), self.optimizer_step(batch[:, 1:].numel())


# -- communication volume ------------------------------------------------------------------------------


class CollectiveLog:
    """(kind, elements of the full tensor, bytes per element, site) of every collective: an all-reduce's
    tensor, an all-gather's output, a reduce-scatter's input (the size the ring algorithm moves (tp-1)/tp
    of). site: the innermost fivefold function on the stack (ours only)."""

    def __init__(self):
        self.calls: list[tuple[str, int, int, str]] = []

    def add(self, kind: str, tensor: torch.Tensor, site: str = "") -> None:
        self.calls.append((kind, tensor.numel(), tensor.element_size(), site))

    def summary(self, tp: int) -> dict:
        return summarize(self.calls, tp)


def summarize(calls, tp: int) -> dict:
    """Counts and payload bytes per (kind, elements), and bytes on the wire per rank for ring algorithms:
    all-reduce 2 (tp-1)/tp x size, all-gather and reduce-scatter (tp-1)/tp x full size."""
    factor = {"all_reduce": 2 * (tp - 1) / tp, "all_gather": (tp - 1) / tp, "reduce_scatter": (tp - 1) / tp}
    counts = Counter((kind, n, size) for kind, n, size, _ in calls)
    sites = Counter((kind, n, site) for kind, n, _, site in calls if site)
    return {"collectives": len(calls),
            "by_kind_and_size": [{"kind": k, "elements": n, "count": c, "bytes": c * n * s}
                                 for (k, n, s), c in sorted(counts.items())],
            "by_site": [{"kind": k, "elements": n, "site": site, "count": c} for (k, n, site), c in sorted(sites.items())],
            "payload_bytes": sum(n * size for _, n, size, _ in calls),
            "wire_bytes_per_rank": sum(factor[kind] * n * size for kind, n, size, _ in calls)}


def _fivefold_site() -> str:
    """The innermost function of the fivefold package on the calling stack (where a collective came from)."""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}fivefold{os.sep}" in frame.f_code.co_filename:
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def count_our_collectives(log: CollectiveLog):
    """Wrap the names our code looks the collectives up by: fivefold.parallel.tensor_parallel's all_gather_into
    / reduce_scatter_into (module-level aliases taken from fivefold.parallel.zero) and dist.all_reduce (looked
    up on the module at call time, by tensor_parallel and by the optimizer's gradient-norm reduction); the
    torch.distributed all-gather / reduce-scatter entry points too, in case anything else calls them. A
    depth counter keeps one collective implemented through another from counting twice."""
    from fivefold.parallel import tensor_parallel as tpl

    depth = [0]

    def wrap(fn, kind, pick):
        def counted(*a, **kw):
            if depth[0] == 0:
                log.add(kind, pick(*a, **kw), _fivefold_site())
            depth[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
        return counted

    first = lambda tensor, *a, **kw: tensor  # all_reduce(tensor) / all_gather(output, input)
    second = lambda output, input, *a, **kw: input  # reduce_scatter(output, input): the full tensor
    targets = [(dist, "all_reduce", "all_reduce", first)]
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            targets.append((dist, name, "all_gather", first))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            targets.append((dist, name, "reduce_scatter", second))
    targets += [(tpl, "all_gather_into", "all_gather", first), (tpl, "reduce_scatter_into", "reduce_scatter", second)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _, _ in targets]
    try:
        for mod, name, kind, pick in targets:
            setattr(mod, name, wrap(getattr(mod, name), kind, pick))
        yield log
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


class CountFunctionalCollectives(TorchDispatchMode):
    """DTensor communicates through functional collectives (torch.ops._c10d_functional), not through
    dist.all_reduce & co.: a dispatch mode sees them (as CommDebugMode does), with their tensors. Any
    other c10d op is logged as "other:<op>" (none expected)."""

    def __init__(self, log: CollectiveLog):
        super().__init__()
        self.log = log
        ops = torch.ops._c10d_functional
        self.kinds = {ops.all_reduce.default: "all_reduce", ops.all_reduce_.default: "all_reduce",
                      ops.all_gather_into_tensor.default: "all_gather",
                      ops.reduce_scatter_tensor.default: "reduce_scatter"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into the collectives first
        out = func(*args, **kwargs)
        kind = self.kinds.get(func)
        if kind == "all_gather":
            self.log.add(kind, out)  # the gathered (full) tensor
        elif kind is not None:
            self.log.add(kind, args[0])  # all-reduce: the tensor; reduce-scatter: the full input
        elif "c10d" in func.namespace and func.namespace != "_c10d_functional" and "wait" not in str(func):
            self.log.calls.append((f"other:{func}", 0, 0, ""))
        return out


def formula(cfg, tp: int) -> dict:
    """The collectives of one training step from the model's shapes (B micro-batch, S seq_len, H hidden,
    L layers, times grad_accum for the per-micro-batch terms), itemized, fp32.

    textbook (Megatron-LM: one column-parallel GEMM for q/k/v and one for gate/up), per layer:
      no SP: 2 all-reduces forward (attention and MLP outputs) + 2 backward (attention and MLP inputs),
             each B*S*H;
      SP:    each becomes an all-gather and a reduce-scatter of the same full size: row-parallel outputs
             reduce-scatter forward / all-gather backward, column-parallel inputs all-gather forward /
             reduce-scatter backward;
    plus the embedding's all-reduce (forward); the LM head input's all-reduce (backward; with SP an all-
    gather forward and a reduce-scatter backward); with SP, the split into the sequence-parallel region's
    all-gather (backward); and the vocab-parallel cross-entropy's all-reduces of B*S maxima and of 2*B*S
    (target logit, denominator).

    ours beyond the textbook (fivefold/parallel/tensor_parallel.py as of this benchmark; q/k/v, gate/up
    and the head share one f or all-gather at their module's entrance, so no SP matches the textbook):
      SP:    SequenceGatheredInput releases the gathered input of the attention, the MLP and the LM head
             after forward and all-gathers it again before their backward (2L + 1); the norm gains'
             gradients (tp_partial_grad) are all-reduced, H numbers each (2L + 1, plus row-parallel biases
             and LayerNorm biases where the model has them);
      once per step: the gradient norm's sum of squares over the sharded parameters (1 number)."""
    m, t = cfg.model, cfg.train
    sp, accum, L = cfg.parallel.sequence_parallel, t.grad_accum, m.num_layers
    bsh, bs = t.micro_batch_size * t.seq_len * m.hidden_size, t.micro_batch_size * t.seq_len
    items = []  # (what, kind, elements, count, textbook?)
    if not sp:
        items += [("row-parallel outputs (o, down), fwd", "all_reduce", bsh, 2 * L),
                  ("column-parallel inputs (attn, mlp), bwd", "all_reduce", bsh, 2 * L),
                  ("embedding, fwd", "all_reduce", bsh, 1),
                  ("LM head input, bwd", "all_reduce", bsh, 1)]
    else:
        items += [("row-parallel outputs (o, down), fwd", "reduce_scatter", bsh, 2 * L),
                  ("row-parallel outputs (o, down), bwd", "all_gather", bsh, 2 * L),
                  ("column-parallel inputs (attn, mlp), fwd", "all_gather", bsh, 2 * L),
                  ("column-parallel inputs (attn, mlp), bwd", "reduce_scatter", bsh, 2 * L),
                  ("embedding, fwd", "all_reduce", bsh, 1),
                  ("LM head input, fwd", "all_gather", bsh, 1),
                  ("LM head input, bwd", "reduce_scatter", bsh, 1),
                  ("SP split, bwd", "all_gather", bsh, 1)]
    items += [("cross-entropy max, fwd", "all_reduce", bs, 1),
              ("cross-entropy target logit + denominator, fwd", "all_reduce", 2 * bs, 1)]
    textbook = [(what, kind, n, c * accum, True) for what, kind, n, c in items]
    extra = []
    if sp:
        extra.append(("input re-gathered before backward (attn, mlp, head)", "all_gather", bsh, (2 * L + 1) * accum))
        whole = (2 * L + 1) * (2 if m.norm == "layernorm" and m.linear_bias else 1) + (2 * L if m.linear_bias else 0)
        extra.append(("norm gains' (and whole biases') gradients, bwd", "all_reduce", m.hidden_size, whole * accum))
    extra.append(("gradient norm of the shards, optimizer", "all_reduce", 1, 1))
    extra = [(what, kind, n, c, False) for what, kind, n, c in extra]

    def calls(rows):
        return [(kind, n, 4, "") for _, kind, n, c, _ in rows for _ in range(c)]

    return {"items": [{"what": w, "kind": k, "elements": n, "count": c, "textbook": tb}
                      for w, k, n, c, tb in textbook + extra],
            "textbook": summarize(calls(textbook), tp), "ours_expected": summarize(calls(textbook + extra), tp)}


def measure_collectives(ours: Ours, ref: TorchTP, tp: int) -> dict:
    log_ours, log_ref = CollectiveLog(), CollectiveLog()
    with count_our_collectives(log_ours):
        ours.step()
    with CountFunctionalCollectives(log_ref):
        ref.step()
    comm = {"ours": log_ours.summary(tp), "dtensor": log_ref.summary(tp), "formula": formula(ours.trainer.cfg, tp)}
    comm["ours_matches_formula"] = (comm["ours"]["by_kind_and_size"]
                                    == comm["formula"]["ours_expected"]["by_kind_and_size"])
    return comm


def print_collectives(comm: dict) -> None:
    def line(name, s):
        kinds = ", ".join(f"{d['count']} {d['kind']} x {d['elements']}" for d in s["by_kind_and_size"])
        print(f"  {name:<17} {s['collectives']:>3} collectives, payload {s['payload_bytes'] / 2**20:6.2f} MiB, "
              f"ring wire/rank {s['wire_bytes_per_rank'] / 2**20:6.2f} MiB: {kinds}")

    print("collectives in one training step (fp32 elements; all-gather: output, reduce-scatter: input):")
    line("ours measured", comm["ours"])
    line("ours formula", comm["formula"]["ours_expected"])
    line("textbook formula", comm["formula"]["textbook"])
    line("DTensor measured", comm["dtensor"])
    print("  ours formula = textbook + " + "; ".join(
        f"{d['count']} {d['kind']} x {d['elements']} ({d['what']})" for d in comm["formula"]["items"] if not d["textbook"]))
    print(f"ours measured == ours formula: {comm['ours_matches_formula']}")
    if not comm["ours_matches_formula"]:
        print("  ours by site: " + "; ".join(f"{d['count']} {d['kind']} x {d['elements']} {d['site']}"
                                             for d in comm["ours"]["by_site"]))


# -- the run -------------------------------------------------------------------------------------------


def code_version() -> dict:
    """The commit, the hash of the tensor-parallel module as it ran, and the package's files that differ
    from the commit (the working tree may be ahead of it)."""
    import hashlib

    import fivefold.parallel.tensor_parallel as tpl

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    with open(tpl.__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"commit": git("rev-parse", "HEAD"), "tensor_parallel_py_sha256": digest,
            "fivefold_uncommitted": git("status", "--porcelain", "--", "fivefold").splitlines()}


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    world = int(os.environ["WORLD_SIZE"])
    load_before = os.getloadavg()  # 1, 5, 15 min: other jobs on the machine
    cfg = make_config(args, world, tempfile.mkdtemp(prefix="fivefold-bench-tp-"))
    # The Trainer starts the gloo process group and the (dp=1, tp) DeviceMesh.
    ours = Ours(cfg)
    ref = TorchTP(cfg, ours.trainer.data, ours.trainer.mesh)
    main = dist.get_rank() == 0
    check = first_step(ours, ref)
    comm = measure_collectives(ours, ref, world)  # step 2 of each side, untimed
    times, cpu = time_alternating({"ours": ours, "dtensor": ref}, max(args.warmup - 2, 0), args.steps)
    if not main:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = cfg.global_batch_tokens
    params = sum(p.numel() for p in ref.params)  # a DTensor's numel is its full size
    m = cfg.model
    print(f"\n{m.hidden_size}h x {m.num_layers}L, {m.num_heads}/{m.num_kv_heads} heads, vocab {m.vocab_size} "
          f"({params / 1e6:.2f}M params, tied {m.tie_embeddings}), tp {world}{' + SP' if args.sp else ''} x "
          f"{args.threads} thread, {tokens} tokens/step")
    print(f"{'impl':<7} | {'median ms':>9} | {'best ms':>7} | {'tokens/s':>8} | {'cpu/wall':>8}")
    for name in times:
        print(f"{name:<7} | {1e3 * med[name]:>9.1f} | {1e3 * min(times[name]):>7.1f} | {tokens / med[name]:>8.0f} | "
              f"{statistics.median(cpu[name]):>8.2f}")
    ratio, best_ratio = med["ours"] / med["dtensor"], min(times["ours"]) / min(times["dtensor"])
    # Each window pair ran back to back: the median of per-pair ratios cancels slow drift in the machine's load.
    paired = statistics.median(o / r for o, r in zip(times["ours"], times["dtensor"]))
    print(f"ratio ours/DTensor (step time; target <= 1.0): median {ratio:.3f}, best {best_ratio:.3f}, "
          f"median of paired windows {paired:.3f}")
    print_collectives(comm)
    if (os.cpu_count() or 1) < world * args.threads:
        print(f"note: {world} x {args.threads} threads on {os.cpu_count()} cores is oversubscribed")
    out = {"machine": machine_info(args, world), "code": code_version(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "first_step": check, "step_times_s": times, "cpu_per_wall": cpu,
           "median_step_s": med, "best_step_s": {k: min(v) for k, v in times.items()},
           "ratio_ours_over_dtensor": ratio, "best_ratio_ours_over_dtensor": best_ratio,
           "paired_ratio_ours_over_dtensor": paired, "collectives": comm,
           "settings": {**{k: v for k, v in vars(args).items() if k != "json"}, "world": world, "tp": world,
                        "global_batch_tokens": tokens, "params": params}}
    write_json(args.json, out)


if __name__ == "__main__":
    main(parse_args, worker, __file__)
