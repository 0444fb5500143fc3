"""Training throughput of fivefold's Trainer against Hugging Face LlamaForCausalLM + torch AdamW.

Both sides train the same model shapes from the same initial weights on the same batches, with the
same threads, loss, gradient clipping and learning rate. Tokens/s and MFU (model FLOPs per token from
fivefold.memory.formulas over a matmul peak) are printed for fp32 and bf16. The peak is the trainer's
(fivefold.train.metrics.mfu_peaks): on a CPU the one measured here; on a GPU a hardware profile describes, its
datasheet figure, with MFU against the measured achievable peak (8192^3, CUDA events) beside it.

    python bench/train_throughput.py                       # bench-30m, seq 512, batch 4, fp32 and bf16
    python bench/train_throughput.py --compile both        # eager and torch.compile side by side
    python bench/train_throughput.py --profile             # + one profiled bf16 step of ours and of HF
    python bench/train_throughput.py --device cuda --precision bf16,fp8   # fp8: GPUs with fp8 tensor cores
    python bench/train_throughput.py --device cuda --json auto            # bench/results/train_throughput_h100.json
    python bench/train_throughput.py --cluster cpu.toml    # a profile from `fivefold calibrate --out cpu.toml`

fp8 is ours under train.precision=fp8 (float8 linears, fivefold.train.fp8) against HF's bf16 autocast, its
MFU over the bf16 matmul peak; on a CPU torchao only emulates it, so it is refused there.

The planner against its own runs: beside each of our rows, the step-time model's tokens/s
(fivefold.planner.speed.predict_step on --cluster; on cuda by default the shipped profile matched from
the device name) and, on cuda, the memory plan's peak (fivefold.memory.plan.plan_memory, its total)
against torch.cuda.max_memory_allocated over that row's timed steps, each for the exact Config the row
trained with.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import tempfile
import time

import torch
from machine import base_info, write_results

from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.data.dataset import ResumableSampler
from fivefold.interop.hf import hf_config_from, weights_to_hf
from fivefold.memory.formulas import count_params, flops_per_token
from fivefold.model import build_model
from fivefold.train.metrics import datasheet_peak_flops, measure_cuda_peak_flops, measure_peak_flops
from fivefold.memory.formulas import is_no_decay
from fivefold.memory.plan import plan_memory
from fivefold.planner.fit import fit_micro_batch
from fivefold.planner.hardware import load_profile, profile_for_device_name
from fivefold.planner.speed import kernel_time, predict_step
from fivefold.train.optim import lr_at
from fivefold.train.trainer import Trainer

# name -> (train.precision, dtype of the matmul peak MFU is measured against; HF's autocast dtype)
PRECISIONS = {"fp32": ("fp32", torch.float32), "bf16": ("bf16-mixed", torch.bfloat16),
              "fp8": ("fp8", torch.bfloat16)}
# fp32, same weights and batch: only op order and rope's fp64-vs-fp32 table differ (observed ~1e-7).
START_RTOL = {"loss": 1e-4, "grad_norm": 1e-5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench-30m")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (sequences per micro-batch)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (both sides)")
    p.add_argument("--fit", action="store_true",
                   help="ours only, at the micro-batch and recomputation `fivefold plan --fit` chooses for the "
                        "device (its memory, and the planner's speed model where a profile matches), keeping "
                        "--batch x --grad-accum sequences per step")
    p.add_argument("--device-memory", type=float, default=0.0, metavar="GB",
                   help="the device memory the plan decisions use (default on cuda: the GPU's; a CPU has none)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per implementation and precision")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile happens here)")
    p.add_argument("--rounds", type=int, default=0, help="alternating timed windows per implementation "
                   "(0: one per step, the fairest under bursty outside load)")
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16, fp8 (fp8: --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="on: ours compiles each block, HF model.compile(); both: time eager and compiled")
    p.add_argument("--fused-projections", choices=["auto", "true", "false", "both"], default="auto",
                   help="our train.fused_projections (q/k/v and gate/up as one GEMM each); both: time ours fused "
                        "(\"ours\") and separate (\"ours-separate\") side by side")
    p.add_argument("--waits", choices=["once", "both"], default="once",
                   help="both: beside ours (one read from the device a step, after the update is queued), "
                        "\"ours-waiting\", the same Trainer made to wait as it did before 2026-11-27: for the loss "
                        "before the optimizer, and for the gradient norm after it")
    p.add_argument("--optimizer-impl", choices=["fused", "foreach", "compiled"], default="fused",
                   help="our train.optimizer_impl (compiled: the whole update as one kernel a tensor, 30 bytes a "
                        "parameter where fused moves 50)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--profile", action="store_true",
                   help="profile one bf16 step of ours and of HF, and of ours in fp8 where timed (top ops; on CUDA "
                        "kernel time against wall time, by kernel kind)")
    p.add_argument("--cluster", metavar="PROFILE",
                   help="hardware profile the planner predicts each row on (a shipped name or a file from `fivefold "
                        "calibrate --out FILE`); default on cuda: the shipped profile matching the device name")
    p.add_argument("--skip-hf", action="store_true",
                   help="time ours only (e.g. fp8 against our bf16 on a model too large for HF's copy beside ours)")
    p.add_argument("--sequential", choices=["auto", "yes", "no"], default="auto",
                   help="yes: build, time and free one runner at a time (no alternating windows); auto: so on "
                        "cuda when the memory plan says a precision's runners do not fit on the device together")
    p.add_argument("--check-batch", type=int, default=1,
                   help="micro-batch of the first-step fp32 check against HF when fp32 is not timed")
    p.add_argument("--check-seq-len", type=int, default=256,
                   help="sequence length of that check (at most --seq-len)")
    p.add_argument("--json", default="", help="write all numbers to this file; a directory or 'auto' (bench/results/): "
                   "train_throughput_<device>.json, e.g. train_throughput_h100.json")
    args = p.parse_args(argv)
    args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]
    bad = [x for x in args.precision if x not in PRECISIONS]
    if bad:
        p.error(f"--precision {','.join(bad)} is not valid; choose from fp32, bf16, fp8")
    if "fp8" in args.precision and args.device != "cuda":
        p.error("--precision fp8 times float8 tensor-core matmuls: use --device cuda (a CPU only emulates them)")
    args.rounds = min(args.rounds or args.steps, args.steps)
    if args.warmup < 1 and args.compile != "off":
        p.error("--compile needs --warmup >= 1: the first step compiles")
    if args.fused_projections == "both" and args.waits == "both":
        p.error("--fused-projections both and --waits both: choose one pair of our runners to compare")
    if args.waits == "both" and args.fit:
        p.error("--waits both times two of our runners at --batch: leave out --fit")
    if args.fused_projections == "both" and args.fit:
        p.error("--fused-projections both times two of our runners at --batch: leave out --fit")
    if args.fit and not args.skip_hf:
        p.error("--fit changes our micro-batch only, so HF would train another shape: add --skip-hf")
    if args.fit and args.device != "cuda" and not args.device_memory:
        p.error("--fit needs a device memory to fill: --device cuda, or --device-memory GB")
    return args


def machine_info(threads: int, device: str) -> dict:
    import transformers
    gpu = {"gpu": torch.cuda.get_device_name()} if device == "cuda" else {}
    return {**base_info(), **gpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "threads": threads}


def device_slug(device: str) -> str:
    """A short name of the device for result files: the part number of a GPU's name ("NVIDIA H100 80GB HBM3"
    -> h100, "NVIDIA A100-SXM4-80GB" -> a100, "NVIDIA H200" -> h200; a PCIe or NVL board adds -pcie / -nvl),
    the whole name made file-safe when it has none; "cpu" on the CPU."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    words = re.split(r"[\s\-_]+", name)
    part = next((w for w in words if re.fullmatch(r"[a-z]{1,2}\d{2,4}[a-z]?", w)), None)
    if part is None:
        return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"
    return "-".join([part] + [w for w in words if w in ("pcie", "nvl")])


def json_path(given: str, slug: str) -> str:
    """--json: a file as given; a directory (existing, or written with a trailing slash) or "auto"
    (bench/results) gets train_throughput_<device>.json."""
    name = f"train_throughput_{slug}.json"
    if given == "auto":
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    if os.path.isdir(given) or given.endswith(os.sep):
        return os.path.join(given, name)
    return given


def planner_profile(args):
    """The hardware profile the planner predicts on, and where it came from; (None, reason) for none."""
    if args.cluster:
        try:
            return load_profile(args.cluster), f"--cluster {args.cluster}"
        except ConfigError as e:
            raise SystemExit(f"train_throughput.py: error: {e}") from None
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        match = profile_for_device_name(name)
        if match is None:
            print(f"planner: no shipped hardware profile matches {name!r}: predictions skipped; give --cluster "
                  f"FILE (e.g. from `fivefold calibrate --out gpu.toml`)")
            return None, "no profile matches"
        return load_profile(match), f"matched from {name!r}"
    print("planner: no --cluster on cpu: predictions skipped (`fivefold calibrate --out cpu.toml`, then "
          "--cluster cpu.toml)")
    return None, "none given"


def add_predictions(results: list[dict], configs: dict, profile, device: str) -> None:
    """Beside each of our rows, from the Config it trained with: the step-time model's tokens/s and its
    error against the measured median (and best) step; on cuda the memory plan's peak (its total on the
    most loaded rank) against the measured peak. Errors are predicted / measured - 1."""
    for r in results:
        if not r["impl"].startswith("ours"):
            continue
        cfg = configs[r["precision"], r["compiled"], r["impl"]]
        speed = predict_step(cfg, profile)
        predicted = speed.tokens_per_s_per_gpu * speed.world
        r.update(predicted_tokens_per_s=predicted, predicted_step_s=speed.step_time_s, predicted_mfu=speed.mfu,
                 predicted_error=predicted / r["tokens_per_s"] - 1,
                 predicted_error_best=predicted / r["best_tokens_per_s"] - 1, predicted_notes=speed.notes)
        if device == "cuda":
            planned = plan_memory(cfg, device=device, suggest=False).memory["total"]
            r.update(planned_peak_bytes=planned, peak_error=planned / r["measured_peak_bytes"] - 1)


def print_predictions(results: list[dict], planner: dict, device: str) -> None:
    cuda = device == "cuda"
    print(f"\nplanner beside our rows: profile {planner['profile']} ({planner['profile_source']}); error = "
          f"predicted / measured - 1")
    if planner["profile_device"] != device:
        print(f"warning: profile {planner['profile']} describes a {planner['profile_device']} device, this run is "
              f"on {device}: the predictions are for another machine")
    memory = f" | {'peak GiB':>8} | {'planned':>7} | {'error':>7}" if cuda else ""
    print(f"{'precision':<9} | {'impl':<13} | {'tokens/s':>8} | {'predicted':>9} | {'error':>7} | "
          f"{'vs best':>7}{memory}")
    for r in results:
        if "predicted_tokens_per_s" not in r:
            continue
        impl = r["impl"] + ("+compile" if r["compiled"] else "")
        memory = (f" | {r['measured_peak_bytes'] / 2**30:>8.2f} | {r['planned_peak_bytes'] / 2**30:>7.2f} | "
                  f"{100 * r['peak_error']:>+6.1f}%" if cuda else "")
        print(f"{r['precision']:<9} | {impl:<13} | {r['tokens_per_s']:>8.0f} | {r['predicted_tokens_per_s']:>9.0f} | "
              f"{100 * r['predicted_error']:>+6.1f}% | {100 * r['predicted_error_best']:>+6.1f}%{memory}")
    for note in dict.fromkeys(n for r in results for n in r.get("predicted_notes", [])):
        print(f"note: {note}")
    if cuda:
        print("peak: torch.cuda.max_memory_allocated over the row's timed steps, less the other runners' resident "
              "memory; planned: fivefold.memory.plan.plan_memory's total")
        if any(r["compiled"] for r in results):
            print("note: compiled rows: the plan's blocks save what torch.compile's min-cut partitioning keeps "
                  "(its notes say where it replays the eager blocks instead, an upper bound)")
    else:
        print(f"peak memory: not compared on {device} (no CUDA allocator statistic; `fivefold memory` measures a "
              f"CPU run's by category)")


def make_config(args, precision: str, compiled: bool, peak: float, out_dir: str, seq_len: int = 0, batch: int = 0,
                fused: str = ""):
    """Our Config for one row; `fused`: train.fused_projections (default: --fused-projections; "true", the "ours"
    row's, under both)."""
    fused = fused or (args.fused_projections if args.fused_projections != "both" else "true")
    overrides = {"train.seq_len": seq_len or args.seq_len, "train.micro_batch_size": batch or args.batch,
                 "train.fused_projections": fused, "train.optimizer_impl": args.optimizer_impl,
                 "train.grad_accum": 1 if batch else args.grad_accum,
                 "train.precision": PRECISIONS[precision][0], "train.compile": compiled, "train.peak_flops": peak,
                 "train.progress": False, "train.tensorboard": False, "train.eval_every": 0,
                 "train.steps": 10_000, "train.device": args.device, "train.out_dir": out_dir,
                 # The batches come from the embedded corpus, whose tokenizer (trained here) ends text with id
                 # 0; a real preset's own id (Llama 3's 128001) belongs to its real tokenizer. No effect on speed.
                 "model.eos_token_id": 0}
    return load_config(preset=args.preset, overrides=[f"{k}={v}" for k, v in overrides.items()])


# Room the allocator needs beyond the plan's tensors (fragmentation, cuBLAS workspaces, compiled graphs).
FIT_HEADROOM = 0.10


def planned_runner(cfg, impl: str) -> tuple[float, float]:
    """(resident, transient) bytes of one runner, from the memory plan: resident = parameters, gradients and
    optimizer states, held between steps; transient = the rest of its peak (activations, temporaries), held
    only while it steps. HF's runner is planned as fp32 weights, gradients and AdamW moments (16 bytes a
    parameter) plus our transient at the same precision and, under autocast, the bf16 weight copies it
    keeps for backward (2 bytes a parameter): an estimate, where ours is the plan itself."""
    plan = plan_memory(cfg, device=cfg.train.device, suggest=False).memory
    resident = plan["parameters"] + plan["gradients"] + plan["optimizer_states"]
    transient = plan["total"] - resident
    if impl == "hf":
        params = count_params(cfg.model)
        resident = 16 * params
        transient += 2 * params if cfg.train.precision != "fp32" else 0
    return resident, transient


def choose_sequential(args, plans: dict, device_bytes: int | None) -> tuple[bool, str]:
    """Whether to time a precision's runners one at a time, and why. Alternating windows hold every runner's
    resident memory at once plus one runner's transient; `plans`: runner -> planned_runner()."""
    if args.sequential != "auto":
        return args.sequential == "yes", f"--sequential {args.sequential}"
    if device_bytes is None or len(plans) < 2:
        return False, "alternating"
    together = sum(r for r, _ in plans.values()) + max(t for _, t in plans.values())
    room = (1 - FIT_HEADROOM) * device_bytes
    if together <= room:
        return False, f"alternating: {together / 2**30:.1f} GiB planned together, {room / 2**30:.1f} GiB usable"
    return True, (f"one at a time: together they plan {together / 2**30:.1f} GiB, over the {room / 2**30:.1f} GiB "
                  f"usable of {device_bytes / 2**30:.1f} GiB")


def check_fits_alone(plans: dict, device_bytes: int | None) -> None:
    """Refuse, before building anything, a run whose own runner the plan says cannot fit the device."""
    if device_bytes is None:
        return
    for (impl, compiled), (resident, transient) in plans.items():
        if impl.startswith("ours") and resident + transient > device_bytes:
            raise SystemExit(f"train_throughput.py: {impl}{'+compile' if compiled else ''} plans "
                             f"{(resident + transient) / 2**30:.1f} GiB, over the device's {device_bytes / 2**30:.1f} "
                             f"GiB: lower --batch or --seq-len (`fivefold plan --preset ... --fit` finds what fits)")


def fitted(cfg, device_bytes: float, profile):
    """`cfg` at the micro-batch, accumulation and recomputation `fivefold plan --fit` chooses for the device:
    what fills its memory (less FIT_HEADROOM) at the same sequences per step, fastest by the planner's speed
    model when a profile matches the device, else by the fewest recomputed FLOPs then the largest micro-batch."""
    result = fit_micro_batch(cfg, int(device_bytes), device=cfg.train.device, headroom=FIT_HEADROOM, profile=profile)
    t = result.config.train
    print(f"--fit ({cfg.train.precision}{', compiled' if cfg.train.compile is True else ''}): micro-batch "
          f"{t.micro_batch_size} x {t.grad_accum} accumulated, recompute {t.recompute}; planned "
          f"{result.chosen.memory / 2**30:.1f} GiB of {device_bytes / 2**30:.1f} GiB"
          + (f", predicted {result.chosen.speed.tokens_per_s_per_gpu:,.0f} tokens/s" if result.chosen.speed else ""))
    return result.config


def cuda_allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


class Runner:
    """`resident`: the GPU bytes this runner holds between its steps (model, optimizer states, ...), the
    allocation its construction and its steps left behind. Runners work one at a time, so the change in
    torch.cuda.memory_allocated across one runner's own calls is its own; the other runners' memory,
    resident all along, is what a timed window's peak must not be charged with (time_alternating)."""

    device, resident = "cpu", 0

    def step(self) -> float:
        before = cuda_allocated(self.device)
        loss = self._step()
        self.resident += cuda_allocated(self.device) - before
        return loss


class Ours(Runner):
    """The real training path: Trainer.train_step (sampler + memmap batch, fwd/bwd, master-weight AdamW)."""

    def __init__(self, cfg, datasets):
        self.device = cfg.train.device
        before = cuda_allocated(self.device)
        self.trainer = Trainer(cfg, quiet=True, datasets=datasets)
        self.resident = cuda_allocated(self.device) - before

    @property
    def steps_done(self) -> int:
        return self.trainer.step

    def _step(self) -> float:
        record = self.trainer.train_step()
        self.grad_norm = record["grad_norm"]
        return record["loss"]


class OursWaiting(Ours):
    """Ours, made to wait for the device where the Trainer's step used to: for the loss once the backward is
    queued (before the optimizer), and for the gradient norm once the update is. On a GPU the difference from
    `Ours` is the host's optimizer work and launch latency the device sat idle through."""

    def __init__(self, cfg, datasets):
        super().__init__(cfg, datasets)
        trainer = self.trainer
        accumulate, step = trainer.accumulate_gradients, trainer.optimizer.step

        def accumulate_then_wait(*args, **kwargs):
            loss = accumulate(*args, **kwargs)
            loss.item()
            return loss

        def step_then_wait(*args, **kwargs):
            norm = step(*args, **kwargs)
            norm.item()
            return norm
        trainer.accumulate_gradients, trainer.optimizer.step = accumulate_then_wait, step_then_wait


class HF(Runner):
    """LlamaForCausalLM (sdpa) + torch AdamW(foreach), the usual HF recipe: an fp32 model, and for bf16
    the HF Trainer's `bf16=True` path, autocast around the forward with fp32 weights and optimizer."""

    def __init__(self, cfg, datasets, initial: dict, bf16: bool, compiled: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        self.device = cfg.train.device
        before = cuda_allocated(self.device)
        hf_cfg = LlamaConfig(**{**hf_config_from(cfg.model, "llama"), "use_cache": False},
                             attn_implementation="sdpa")
        # Built where it trains: a 1B model's random initialisation takes HF ~15-20 s on a few host cores, and
        # the 1B benchmark builds two (the fp32 check's and the timed one).
        with torch.device(self.device):
            self.model = LlamaForCausalLM(hf_cfg).train()
        self.model.load_state_dict(weights_to_hf(initial, cfg.model), strict=True)
        if compiled:
            self.model.compile()
        t = cfg.train
        named = list(self.model.named_parameters())
        groups = [{"params": [p for n, p in named if not is_no_decay(n)], "weight_decay": t.weight_decay},
                  {"params": [p for n, p in named if is_no_decay(n)], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
        self.params = [p for _, p in named]
        # Same seed, same dataset: the same batches as our Trainer, step for step.
        self.data, self.sampler = datasets.train, ResumableSampler(len(datasets.train), t.seed)
        self.cfg, self.bf16, self.steps_done = cfg, bf16, 0
        self.resident = cuda_allocated(self.device) - before

    def _step(self) -> float:
        t = self.cfg.train
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed as the floats were
        for _ in range(t.grad_accum):  # equal micro-batches: the mean of their mean losses is the step's
            batch = self.data.batch(self.sampler.take(t.micro_batch_size))  # (B, S + 1)
            batch = batch.to(self.device)
            inputs, labels = batch[:, :-1], batch[:, 1:].contiguous()  # HF's loss .view()s the labels
            # shift_labels: HF's own loss on exactly our next-token labels (all S positions, not S - 1).
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.model(input_ids=inputs, labels=labels, shift_labels=labels).loss / t.grad_accum
            loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip, foreach=True)
        tokens = labels.numel() * t.grad_accum
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.steps_done, t, tokens, tokens)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        # One read of the step's loss and norm, after the update is queued: the wait our Trainer has, so neither
        # side's step time carries host syncs the other's does not (HF's Trainer reads only at logging steps).
        loss, self.grad_norm = torch.stack([total, grad_norm.double()]).tolist()
        return loss


def time_alternating(runners: dict, warmup: int, steps: int, rounds: int) -> tuple[dict, dict, dict]:
    """Warm each runner up, then interleave timed windows (A, B, A, B, ...), so a burst of outside load
    lands on every implementation rather than on whichever happened to run then. Also returns each
    step's CPU utilisation, process CPU time / (wall * threads): well below 1 means the threads were
    not all running (other load, or a host taking vCPUs away), so that step's time is inflated. And on
    cuda each runner's peak memory over its timed windows, as if it ran alone: the allocator's peak in
    the window above the allocation at its start (which holds every runner's resident memory), plus the
    runner's own resident bytes; and beside it the allocator's peak itself (all runners)."""
    for runner in runners.values():
        while runner.steps_done < warmup:  # a runner reused from the loss check has one step done
            runner.step()
    times, utils = {name: [] for name in runners}, {name: [] for name in runners}
    peaks = {}
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    for n in per_round:
        for name, runner in runners.items():
            cuda = runner.device == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                start_allocated, own = torch.cuda.memory_allocated(), runner.resident
            for _ in range(n):
                start, cpu = time.perf_counter(), time.process_time()
                runner.step()
                wall = time.perf_counter() - start
                times[name].append(wall)
                utils[name].append((time.process_time() - cpu) / (wall * torch.get_num_threads()))
            if cuda:
                raw = torch.cuda.max_memory_allocated()
                was = peaks.get(name, (0, 0))
                peaks[name] = (max(was[0], raw - start_allocated + own), max(was[1], raw))
    return times, utils, peaks


def window_note(times: list[float], steps: int, rounds: int) -> str:
    """With windows of several steps (--rounds < --steps): the median first step of a window beside the median
    of the rest, which says whether switching between the runners costs the step after the switch."""
    if not rounds or rounds >= steps:
        return ""
    sizes = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    starts = {sum(sizes[:i]) for i in range(rounds)}
    first = [t for i, t in enumerate(times) if i in starts]
    rest = [t for i, t in enumerate(times) if i not in starts]
    return (f"; a window's first step {1e3 * statistics.median(first):.1f} ms, the others "
            f"{1e3 * statistics.median(rest):.1f} ms")


def release_memory(device: str) -> None:
    """Free what dropped runners held before the next ones are built (cycles first, then the allocator's
    cache, so the next runner's peak is measured from a clean start)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def check_same_start(ours: Ours, hf: HF) -> dict:
    """First fp32 step of ours and HF on the same batch. At init the loss is ~ln(vocab) whatever the
    weights (scaling one of the 57 matrices by 1.01 moves it by ~8e-6 relative), so the pre-clip
    gradient norm, which that moves by ~2e-4, is compared too."""
    out = {"loss_ours": ours.step(), "loss_hf": hf.step(), "grad_norm_ours": ours.grad_norm,
           "grad_norm_hf": hf.grad_norm}
    for key in ("loss", "grad_norm"):
        a, b = out[f"{key}_ours"], out[f"{key}_hf"]
        out[f"{key}_rel_diff"] = rel = abs(a - b) / abs(b)
        print(f"first-step fp32 {key}: ours {a:.6f}  HF {b:.6f}  rel diff {rel:.2e}")
        assert rel < START_RTOL[key], f"ours and HF start differently: {key} rel diff {rel:.2e}"
    return out


def profile_step(runner: Runner, device: str, rows: int = 25) -> dict:
    """One step of `runner` under torch.profiler, after two more to warm it: the top ops by self time on the
    device (on the host for a CPU run), the step's wall time and, on CUDA, its kernels' summed time and
    count. A step whose kernels sum to well under its wall time waits on the host (launches, syncs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    runner.step()
    runner.step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        runner.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=rows)
    out = {"wall_s": wall, "table": table}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        kinds = dict.fromkeys(MEASURED_KINDS, 0.0)
        for e in kernels:
            kinds[kernel_kind(e.name)] += e.self_device_time_total / 1e6
        out.update(kernel_s=sum(e.self_device_time_total for e in kernels) / 1e6, kernels=len(kernels),
                   kernel_kinds_s=kinds)
    return out


# Kernel kinds by name, first match wins: cuDNN's and FlashAttention's attention kernels, cuBLAS's GEMMs (nvjet on
# Hopper with CUDA 13, sm90_xmma / cutlass before) and inductor's matmul templates, the optimizer's multi-tensor
# kernels (fused AdamW, foreach norm, copy and scale), and the rest of what inductor and ATen launch (norms,
# activations, RoPE, the loss, casts). The planner's kernel_time prices the same kinds.
KERNEL_NAMES = (("attention", ("flash", "fmha", "sdpa", "attention")),
                ("matmul", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "triton_tem")),
                ("optimizer", ("adam", "multi_tensor")),
                ("elementwise", ("triton", "elementwise", "reduce", "softmax", "norm", "copy", "cat", "index", "fill")))
MEASURED_KINDS = tuple(kind for kind, _ in KERNEL_NAMES) + ("other",)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KERNEL_NAMES if any(w in lower for w in words)), "other")


def profile_runners(makers: dict, device: str) -> dict:
    """{runner name: profile_step of it}, one runner alive at a time."""
    profiles = {}
    for name, make in makers.items():
        runner = make()
        profiles[name] = profile_step(runner, device)
        del runner
        release_memory(device)
        p = profiles[name]
        busy = f", kernels {1e3 * p['kernel_s']:.1f} ms ({p['kernels']} launches)" if "kernel_s" in p else ""
        kind = "fp8" if name.endswith("fp8") else "bf16-mixed"
        print(f"\n{name}, one profiled {kind} step: wall {1e3 * p['wall_s']:.1f} ms{busy}; top ops by self "
              f"{'device' if 'kernel_s' in p else 'CPU'} time:\n{p['table']}")
        if "kernel_kinds_s" in p:
            print(f"{name}'s kernels by kind: " + ", ".join(f"{kind} {1e3 * v:.1f} ms" for kind, v in
                                                           p["kernel_kinds_s"].items()))
    return profiles


def predicted_kinds(cfg, profile, name: str = "ours") -> dict | None:
    """The planner's device time of one step of `cfg` by kernel kind (fivefold.planner.speed.kernel_time), beside
    the profile's measured kinds; None without a profile or with pipeline stages."""
    if profile is None or cfg.parallel.pp > 1:
        return None
    kinds = kernel_time(cfg, profile)
    print(f"planner's kernel time by kind, {name}: "
          + ", ".join(f"{kind} {1e3 * v:.1f} ms" for kind, v in kinds.items())
          + " (launches: its per-kernel overhead, which a profile counts in no kernel)")
    return kinds


def sample_peaks(peaks: dict[str, list[float]], device: str) -> None:
    # Outside load can only slow a matmul down, so the fastest of several samples spread over the run
    # is the best estimate of what this machine's kernels can do. On a GPU: large products timed by CUDA
    # events, the trainer's measured achievable peak.
    # fp8's rows compute in bf16 outside their float8 linears and their MFU is against bf16's peak (fivefold.train.
    # metrics): one bf16 measurement serves both (a second one read up to 7% apart on an H200 and was printed as
    # fp8's peak).
    measure = measure_cuda_peak_flops if device == "cuda" else measure_peak_flops
    measured = {dtype: measure(torch.device(device), dtype) for dtype in dict.fromkeys(d for _, d in PRECISIONS.values())}
    for p, (_, dtype) in PRECISIONS.items():
        peaks[p].append(measured[dtype])


def summarize(times: dict, utils: dict, peaks: dict, precision: str, tokens: int) -> list[dict]:
    rows = []
    for (impl, compiled), ts in times.items():
        util = utils[(impl, compiled)]
        rows.append({"precision": precision, "impl": impl, "compiled": compiled, "step_times_s": ts,
                     "cpu_util": util, "median_cpu_util": statistics.median(util),
                     "median_step_s": statistics.median(ts), "best_step_s": min(ts),
                     "tokens_per_s": tokens / statistics.median(ts), "best_tokens_per_s": tokens / min(ts)})
        if (impl, compiled) in peaks:  # on cuda: this runner's own, and the device's (every runner resident)
            rows[-1]["measured_peak_bytes"], rows[-1]["device_peak_bytes"] = peaks[impl, compiled]
    for r in rows:
        hf = next((x for x in rows if x["impl"] == "hf" and x["compiled"] == r["compiled"]), None)
        r["ratio_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"] if hf else None  # --skip-hf: no HF row
        r["best_ratio_vs_hf"] = r["best_tokens_per_s"] / hf["best_tokens_per_s"] if hf else None
    return rows


def print_table(results: list[dict], cpu: bool = True) -> None:
    # With a datasheet peak, MFU is against it and "achv" against the measured achievable peak. The CPU
    # utilisation (a CPU run's contention check) is left out on a GPU, where the host mostly waits.
    achievable = any("mfu_achievable" in r for r in results)
    extra = f" | {'achv':>5}" if achievable else ""
    print(f"\n{'precision':<9} | {'impl':<13} | {'tokens/s':>8} | {'step ms':>7} | {'MFU':>5}{extra} | "
          f"{'ratio vs HF':>11} | best: tokens/s  MFU  ratio" + (" | cpu util" if cpu else ""))
    print("-" * (108 + len(extra)))
    for r in results:
        impl = r["impl"] + ("+compile" if r["compiled"] else "")
        extra = f" | {100 * r['mfu_achievable']:>4.1f}%" if achievable else ""
        ratio, best_ratio = (("-", "-") if r["ratio_vs_hf"] is None else
                             (f"{r['ratio_vs_hf']:.3f}", f"{r['best_ratio_vs_hf']:.3f}"))
        print(f"{r['precision']:<9} | {impl:<13} | {r['tokens_per_s']:>8.0f} | {1e3 * r['median_step_s']:>7.0f} | "
              f"{100 * r['mfu']:>4.1f}%{extra} | {ratio:>11} | {r['best_tokens_per_s']:>8.0f} "
              f"{100 * r['best_mfu']:>5.1f}% {best_ratio:>6}" + (f" | {r['median_cpu_util']:>8.2f}" if cpu else ""))
    if achievable:
        print("MFU: of the datasheet peak; achv: of the measured achievable peak")
    if cpu and min(r["median_cpu_util"] for r in results) < 0.8:
        print("warning: median CPU utilisation < 0.8: the machine was contended; compare the best columns, rerun")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info(torch.get_num_threads(), args.device)
    print(f"{info['cpu_model']} ({info['cpu_capability']}), {info['threads']} threads, torch {info['torch']}, "
          f"transformers {info['transformers']}")
    profile, profile_source = planner_profile(args)
    peak_samples = {p: [] for p in PRECISIONS}
    for _ in range(3):
        sample_peaks(peak_samples, args.device)

    tmp = tempfile.TemporaryDirectory(prefix="fivefold-bench-")
    base = make_config(args, "fp32", False, max(peak_samples["fp32"]), tmp.name)
    from fivefold.data.load import load_datasets
    datasets = load_datasets(base)  # trains/caches the tokenizer and token shards before any timing
    # The Trainer's init, for HF's copy (none to copy with --skip-hf: a 3B model's takes a minute on the host)
    initial = None if args.skip_hf else build_model(base.model, "cpu", seed=base.train.seed).state_dict()
    fpt = flops_per_token(base.model, args.seq_len)
    tokens = args.batch * args.grad_accum * args.seq_len
    print(f"{args.preset}: {count_params(base.model) / 1e6:.1f}M params, {fpt / 1e6:.1f} MFLOP/token, "
          f"{tokens} tokens/step")
    device_bytes = (args.device_memory * 1e9 if args.device_memory else
                    torch.cuda.mem_get_info()[1] if args.device == "cuda" else None)
    timed_fp32 = "fp32" in args.precision
    checked, check = {}, None
    if args.skip_hf:
        print("first-step check against HF: skipped (--skip-hf)")
    else:
        # When fp32 is timed, the checked pair at the timed size become its runners; otherwise the check runs
        # small (a 1B model's two fp32 copies at seq 2048 do not fit an 80 GB GPU) and is freed after.
        check_cfg = base if timed_fp32 else make_config(args, "fp32", False, max(peak_samples["fp32"]), tmp.name,
                                                        min(args.check_seq_len, args.seq_len), args.check_batch)
        if timed_fp32 and device_bytes:
            check_fits_alone({("ours", False): planned_runner(base, "ours")}, device_bytes)
        check_data = datasets if timed_fp32 else load_datasets(check_cfg)  # windows of the check's length
        checked = {("ours", False): Ours(check_cfg, check_data),
                   ("hf", False): HF(check_cfg, check_data, initial, bf16=False, compiled=False)}
        check = check_same_start(*checked.values())
        if not timed_fp32:
            checked.clear()
            release_memory(args.device)
    configs = {}  # each row's exact Config, for the planner's predictions: (precision, compiled, impl) -> Config
    # --fused-projections both: ours fused and ours separate, as two runners of the same shapes
    ours = ({"ours": "true", "ours-separate": "false"} if args.fused_projections == "both" else
            {"ours": "", "ours-waiting": ""} if args.waits == "both" else {"ours": ""})

    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results, schedule = [], {}
    for precision in args.precision:
        makers, plans = {}, {}
        for compiled in variants:
            for impl, fused in ours.items():
                cfg = make_config(args, precision, compiled, max(peak_samples[precision]), tmp.name, fused=fused)
                configs[precision, compiled, impl] = fitted(cfg, device_bytes, profile) if args.fit else cfg
            for impl in (*ours, *(() if args.skip_hf else ("hf",))):
                # HF trains the shapes of our (first) row; its memory is planned from that row's Config too
                cfg = configs[precision, compiled, impl if impl in ours else "ours"]
                if device_bytes:
                    plans[impl, compiled] = planned_runner(cfg, impl)
                if (impl, compiled) in checked:  # the checked pair, one warmup step already done
                    makers[impl, compiled] = lambda runner=checked.pop((impl, compiled)): runner
                elif impl in ours:
                    runner = OursWaiting if impl == "ours-waiting" else Ours
                    makers[impl, compiled] = lambda cfg=cfg, runner=runner: runner(cfg, datasets)
                else:
                    makers[impl, compiled] = lambda cfg=cfg, compiled=compiled: HF(
                        cfg, datasets, initial, bf16=precision != "fp32", compiled=compiled)
        check_fits_alone(plans, device_bytes)
        sequential, why = choose_sequential(args, plans, device_bytes)
        schedule[precision] = why
        print(f"timing {precision}: {', '.join(i + ('+compile' if c else '') for i, c in makers)}; warmup "
              f"{args.warmup}, {args.steps} steps each, {why} ...", flush=True)
        if sequential:
            times, utils, peaks_seen = {}, {}, {}
            for name, make in list(makers.items()):
                runner = make()
                t, u, p = time_alternating({name: runner}, args.warmup, args.steps, args.rounds)
                times.update(t)
                utils.update(u)
                peaks_seen.update(p)
                del runner, makers[name]
                release_memory(args.device)
        else:
            runners = {name: make() for name, make in makers.items()}
            times, utils, peaks_seen = time_alternating(runners, args.warmup, args.steps, args.rounds)
            del runners
        del makers
        release_memory(args.device)
        rows = summarize(times, utils, peaks_seen, precision, tokens)
        for r in rows:  # each row's shape (--fit changes ours'), and whether our loss was compiled too
            cfg = configs[precision, r["compiled"], r["impl"]] if r["impl"] in ours else None
            t = cfg.train if cfg else None
            r.update(micro_batch_size=t.micro_batch_size if t else args.batch,
                     grad_accum=t.grad_accum if t else args.grad_accum, recompute=t.recompute if t else "none")
            if cfg:
                r["loss_compiled"] = cfg.compiled_loss(args.device)
                r["fused_projections"] = dict(zip(("qkv", "gate_up"), cfg.fused_projections(args.device)))
                if t.precision == "fp8":
                    r["fp8_weight_cast"] = "step" if cfg.fp8_cast_once(args.device) else "use"
        # At once, so a run cut short (a time limit on a lent GPU) still shows what it timed.
        for r in rows:
            impl = r["impl"] + ("+compile" if r["compiled"] else "")
            print(f"  {precision} {impl}: {r['tokens_per_s']:,.0f} tokens/s (median step {1e3 * r['median_step_s']:.1f} "
                  f"ms){window_note(r['step_times_s'], args.steps, args.rounds)}", flush=True)
        results += rows
        sample_peaks(peak_samples, args.device)

    peaks = {p: max(v) for p, v in peak_samples.items()}
    print("measured matmul peak (best of %d): " % len(peak_samples["fp32"])
          + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items() if p != "fp8")
          + " (fp8 rows: against bf16's)")
    # The trainer's choice (fivefold.train.metrics.mfu_peaks): a known GPU's datasheet peak, else the measured.
    datasheet = {p: datasheet_peak_flops(torch.device(args.device), dtype) for p, (_, dtype) in PRECISIONS.items()}
    datasheet = {p: d[0] for p, d in datasheet.items() if d is not None}
    if datasheet:
        print("datasheet matmul peak: " + ", ".join(f"{p} {v / 1e12:.0f} TFLOP/s" for p, v in datasheet.items()
                                                    if p != "fp8"))
    for r in results:
        peak = datasheet.get(r["precision"], peaks[r["precision"]])
        r["mfu"] = r["tokens_per_s"] * fpt / peak
        r["best_mfu"] = r["best_tokens_per_s"] * fpt / peak
        if r["precision"] in datasheet:
            r["mfu_achievable"] = r["tokens_per_s"] * fpt / peaks[r["precision"]]
    print_table(results, cpu=args.device == "cpu")
    planner = {"profile": None, "profile_source": profile_source}  # predictions skipped
    if profile is not None:
        planner = {"profile": profile.name, "profile_source": profile_source, "profile_device": profile.device,
                   "profile_toml": profile.to_toml()}  # the figures the predictions were made with
        add_predictions(results, configs, profile, args.device)
        print_predictions(results, planner, args.device)

    profiles = {}
    if args.profile:  # our bf16 step (and fp8's where it was timed) and, unless skipped, HF's, compiled as timed
        compiled = args.compile == "on"
        cfgs = {"ours": configs.get(("bf16", compiled, "ours"))
                or make_config(args, "bf16", compiled, peaks["bf16"], tmp.name)}
        if ("fp8", compiled, "ours") in configs:  # where fp8's step differs from bf16's, kind by kind
            cfgs["ours_fp8"] = configs["fp8", compiled, "ours"]
        makers = {name: lambda cfg=cfg: Ours(cfg, datasets) for name, cfg in cfgs.items()}
        if not args.skip_hf:
            makers["hf"] = lambda: HF(cfgs["ours"], datasets, initial, bf16=True, compiled=compiled)
        profiles = profile_runners(makers, args.device)
        for name, cfg in cfgs.items():
            predicted = predicted_kinds(cfg, profile, name)
            if predicted is not None:
                profiles[name]["predicted_kinds_s"] = predicted
    out = {"machine": info, "peak_flops": peaks, "peak_flops_samples": peak_samples, "datasheet_peak_flops": datasheet,
           "first_step_loss_fp32": check, "schedule": schedule, "results": results, "profiles_bf16": profiles,
           "planner": planner,
           "settings": {"preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
                        "warmup": args.warmup, "rounds": args.rounds, "compile": args.compile,
                        "grad_accum": args.grad_accum, "fit": args.fit, "skip_hf": args.skip_hf,
                        "sequential": args.sequential, "fused_projections": args.fused_projections, "waits": args.waits,
                        "optimizer_impl": args.optimizer_impl,
                        "tokens_per_step": tokens, "flops_per_token": fpt, "params": count_params(base.model)}}
    if args.json:
        write_results(json_path(args.json, device_slug(args.device)), out)
    tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
