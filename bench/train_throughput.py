"""Training throughput of fivefold's Trainer against Hugging Face LlamaForCausalLM + torch AdamW.

Both sides train the same model shapes from the same initial weights on the same batches, with the
same threads, loss, gradient clipping and learning rate. Tokens/s and MFU (model FLOPs per token from
fivefold.memory.formulas over a matmul peak) are printed for fp32 and bf16. The peak is the trainer's
(fivefold.train.metrics.mfu_peaks): on a CPU the one measured here; on a GPU a hardware profile describes, its
datasheet figure, with MFU against the measured achievable peak (8192^3, CUDA events) beside it.

    python bench/train_throughput.py                       # bench-30m, seq 512, batch 4, fp32 and bf16
    python bench/train_throughput.py --compile both        # eager and torch.compile side by side
    python bench/train_throughput.py --profile             # + top ops of one bf16 step of ours
    python bench/train_throughput.py --device cuda --precision bf16,fp8   # fp8: GPUs with fp8 tensor cores

fp8 is ours under train.precision=fp8 (float8 linears, fivefold.train.fp8) against HF's bf16 autocast, its
MFU over the bf16 matmul peak; on a CPU torchao only emulates it, so it is refused there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from fivefold.config import load_config
from fivefold.data.dataset import ResumableSampler
from fivefold.interop.hf import hf_config_from, weights_to_hf
from fivefold.memory.formulas import count_params, flops_per_token
from fivefold.model import build_model
from fivefold.train.metrics import datasheet_peak_flops, measure_cuda_peak_flops, measure_peak_flops
from fivefold.memory.formulas import is_no_decay
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
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (sequences per step)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per implementation and precision")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile happens here)")
    p.add_argument("--rounds", type=int, default=0, help="alternating timed windows per implementation "
                   "(0: one per step, the fairest under bursty outside load)")
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16, fp8 (fp8: --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="on: ours compiles each block, HF model.compile(); both: time eager and compiled")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--profile", action="store_true", help="profile one bf16 step of ours (top ops)")
    p.add_argument("--json", default="", help="write all numbers here")
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
    return args


def machine_info(threads: int) -> dict:
    import transformers
    from machine import base_info
    return {**base_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "threads": threads}


def make_config(args, precision: str, compiled: bool, peak: float, out_dir: str):
    overrides = {"train.seq_len": args.seq_len, "train.micro_batch_size": args.batch, "train.grad_accum": 1,
                 "train.precision": PRECISIONS[precision][0], "train.compile": compiled, "train.peak_flops": peak,
                 "train.progress": False, "train.tensorboard": False, "train.eval_every": 0,
                 "train.steps": 10_000, "train.device": args.device, "train.out_dir": out_dir}
    return load_config(preset=args.preset, overrides=[f"{k}={v}" for k, v in overrides.items()])


class Ours:
    """The real training path: Trainer.train_step (sampler + memmap batch, fwd/bwd, master-weight AdamW)."""

    def __init__(self, cfg, datasets):
        self.trainer = Trainer(cfg, quiet=True, datasets=datasets)

    @property
    def steps_done(self) -> int:
        return self.trainer.step

    def step(self) -> float:
        record = self.trainer.train_step()
        self.grad_norm = record["grad_norm"]
        return record["loss"]


class HF:
    """LlamaForCausalLM (sdpa) + torch AdamW(foreach), the usual HF recipe: an fp32 model, and for bf16
    the HF Trainer's `bf16=True` path, autocast around the forward with fp32 weights and optimizer."""

    def __init__(self, cfg, datasets, initial: dict, bf16: bool, compiled: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(**{**hf_config_from(cfg.model, "llama"), "use_cache": False},
                             attn_implementation="sdpa")
        self.model = LlamaForCausalLM(hf_cfg).train()
        self.model.load_state_dict(weights_to_hf(initial, cfg.model), strict=True)
        self.device = torch.device(cfg.train.device)
        self.model.to(self.device)
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

    def step(self) -> float:
        t = self.cfg.train
        batch = self.data.batch(self.sampler.take(t.micro_batch_size))  # (B, S + 1)
        batch = batch.to(self.device)
        inputs, labels = batch[:, :-1], batch[:, 1:].contiguous()  # HF's loss .view()s the labels
        # shift_labels: HF's own loss on exactly our next-token labels (all S positions, not S - 1).
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=inputs, labels=labels, shift_labels=labels).loss
        loss.backward()
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip, foreach=True).item()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.steps_done, t, labels.numel(), labels.numel())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return loss.item()


def time_alternating(runners: dict, warmup: int, steps: int, rounds: int) -> tuple[dict, dict]:
    """Warm each runner up, then interleave timed windows (A, B, A, B, ...), so a burst of outside load
    lands on every implementation rather than on whichever happened to run then. Also returns each
    step's CPU utilisation, process CPU time / (wall * threads): well below 1 means the threads were
    not all running (other load, or a host taking vCPUs away), so that step's time is inflated."""
    for runner in runners.values():
        while runner.steps_done < warmup:  # a runner reused from the loss check has one step done
            runner.step()
    times, utils = {name: [] for name in runners}, {name: [] for name in runners}
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    for n in per_round:
        for name, runner in runners.items():
            for _ in range(n):
                start, cpu = time.perf_counter(), time.process_time()
                runner.step()
                wall = time.perf_counter() - start
                times[name].append(wall)
                utils[name].append((time.process_time() - cpu) / (wall * torch.get_num_threads()))
    return times, utils


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


def profile_ours(cfg, datasets, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    ours = Ours(cfg, datasets)
    ours.step()
    ours.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ours.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def sample_peaks(peaks: dict[str, list[float]], device: str) -> None:
    # Outside load can only slow a matmul down, so the fastest of several samples spread over the run
    # is the best estimate of what this machine's kernels can do. On a GPU: large products timed by CUDA
    # events, the trainer's measured achievable peak.
    measure = measure_cuda_peak_flops if device == "cuda" else measure_peak_flops
    for p, (_, dtype) in PRECISIONS.items():
        peaks[p].append(measure(torch.device(device), dtype))


def summarize(times: dict, utils: dict, precision: str, tokens: int) -> list[dict]:
    rows = []
    for (impl, compiled), ts in times.items():
        util = utils[(impl, compiled)]
        rows.append({"precision": precision, "impl": impl, "compiled": compiled, "step_times_s": ts,
                     "cpu_util": util, "median_cpu_util": statistics.median(util),
                     "median_step_s": statistics.median(ts), "best_step_s": min(ts),
                     "tokens_per_s": tokens / statistics.median(ts), "best_tokens_per_s": tokens / min(ts)})
    for r in rows:
        hf = next(x for x in rows if x["impl"] == "hf" and x["compiled"] == r["compiled"])
        r["ratio_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
        r["best_ratio_vs_hf"] = r["best_tokens_per_s"] / hf["best_tokens_per_s"]
    return rows


def print_table(results: list[dict]) -> None:
    # With a datasheet peak, MFU is against it and "achv" against the measured achievable peak.
    achievable = any("mfu_achievable" in r for r in results)
    extra = f" | {'achv':>5}" if achievable else ""
    print(f"\n{'precision':<9} | {'impl':<13} | {'tokens/s':>8} | {'step ms':>7} | {'MFU':>5}{extra} | "
          f"{'ratio vs HF':>11} | best: tokens/s  MFU  ratio | cpu util")
    print("-" * (108 + len(extra)))
    for r in results:
        impl = r["impl"] + ("+compile" if r["compiled"] else "")
        extra = f" | {100 * r['mfu_achievable']:>4.1f}%" if achievable else ""
        print(f"{r['precision']:<9} | {impl:<13} | {r['tokens_per_s']:>8.0f} | {1e3 * r['median_step_s']:>7.0f} | "
              f"{100 * r['mfu']:>4.1f}%{extra} | {r['ratio_vs_hf']:>11.3f} | {r['best_tokens_per_s']:>8.0f} "
              f"{100 * r['best_mfu']:>5.1f}% {r['best_ratio_vs_hf']:>6.3f} | {r['median_cpu_util']:>8.2f}")
    if achievable:
        print("MFU: of the datasheet peak; achv: of the measured achievable peak")
    if min(r["median_cpu_util"] for r in results) < 0.8:
        print("warning: median CPU utilisation < 0.8: the machine was contended; compare the best columns, rerun")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info(torch.get_num_threads())
    print(f"{info['cpu_model']} ({info['cpu_capability']}), {info['threads']} threads, torch {info['torch']}, "
          f"transformers {info['transformers']}")
    peak_samples = {p: [] for p in PRECISIONS}
    for _ in range(3):
        sample_peaks(peak_samples, args.device)

    tmp = tempfile.TemporaryDirectory(prefix="fivefold-bench-")
    base = make_config(args, "fp32", False, max(peak_samples["fp32"]), tmp.name)
    from fivefold.data.dataset import load_datasets
    datasets = load_datasets(base)  # trains/caches the tokenizer and token shards before any timing
    initial = build_model(base.model, "cpu", seed=base.train.seed).state_dict()  # the Trainer's init
    fpt = flops_per_token(base.model, args.seq_len)
    tokens = args.batch * args.seq_len
    print(f"{args.preset}: {count_params(base.model) / 1e6:.1f}M params, {fpt / 1e6:.1f} MFLOP/token, "
          f"{tokens} tokens/step")
    checked = {("ours", False): Ours(base, datasets),
               ("hf", False): HF(base, datasets, initial, bf16=False, compiled=False)}
    check = check_same_start(*checked.values())
    if "fp32" not in args.precision:
        checked.clear()

    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results = []
    for precision in args.precision:
        runners = {}
        for compiled in variants:
            cfg = make_config(args, precision, compiled, max(peak_samples[precision]), tmp.name)
            if precision == "fp32" and not compiled:  # the checked pair, one warmup step already done
                runners.update(checked)
                checked = {}
                continue
            runners[("ours", compiled)] = Ours(cfg, datasets)
            runners[("hf", compiled)] = HF(cfg, datasets, initial, bf16=precision != "fp32", compiled=compiled)
        print(f"timing {precision}: {', '.join(i + ('+compile' if c else '') for i, c in runners)}; warmup "
              f"{args.warmup}, {args.steps} steps each in {args.rounds} alternating windows ...", flush=True)
        results += summarize(*time_alternating(runners, args.warmup, args.steps, args.rounds), precision, tokens)
        del runners
        sample_peaks(peak_samples, args.device)

    peaks = {p: max(v) for p, v in peak_samples.items()}
    print("measured matmul peak (best of %d): " % len(peak_samples["fp32"])
          + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
    # The trainer's choice (fivefold.train.metrics.mfu_peaks): a known GPU's datasheet peak, else the measured.
    datasheet = {p: datasheet_peak_flops(torch.device(args.device), dtype) for p, (_, dtype) in PRECISIONS.items()}
    datasheet = {p: d[0] for p, d in datasheet.items() if d is not None}
    if datasheet:
        print("datasheet matmul peak: " + ", ".join(f"{p} {v / 1e12:.0f} TFLOP/s" for p, v in datasheet.items()))
    for r in results:
        peak = datasheet.get(r["precision"], peaks[r["precision"]])
        r["mfu"] = r["tokens_per_s"] * fpt / peak
        r["best_mfu"] = r["best_tokens_per_s"] * fpt / peak
        if r["precision"] in datasheet:
            r["mfu_achievable"] = r["tokens_per_s"] * fpt / peaks[r["precision"]]
    print_table(results)

    profile = ""
    if args.profile:
        profile = profile_ours(make_config(args, "bf16", args.compile == "on", peaks["bf16"], tmp.name), datasets)
        print("\nours, one bf16-mixed step, top ops by self CPU time:\n" + profile)
    out = {"machine": info, "peak_flops": peaks, "peak_flops_samples": peak_samples, "datasheet_peak_flops": datasheet,
           "first_step_loss_fp32": check, "results": results, "profile_bf16_ours": profile,
           "settings": {"preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
                        "warmup": args.warmup, "rounds": args.rounds, "compile": args.compile,
                        "tokens_per_step": tokens, "flops_per_token": fpt, "params": count_params(base.model)}}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
