"""The host's part of one optimizer step: how long `MasterWeightAdamW.step` takes to return, over a model's own
parameter list, for the fused, the foreach and the compiled update (train.optimizer_impl), beside
torch.optim.AdamW.step called once over fp32 copies of the same parameters (the reference: a plain loop's
optimizer, without chunks, clipping or bf16 copies; the fused one for the compiled update).

    python bench/optimizer_host.py [--preset smollm2-135m] [--device cpu|cuda] [--full] [--json FILE]

`--full` keeps the preset's width on a CPU: the step's time is then mostly its memory traffic, which is what
the compiled update cuts (30 bytes a parameter against the fused step's 50, fivefold.train.compiled_adamw).

On a GPU the call returns once its kernels are queued, so its wall time is the host's work (Python, launches)
and the device's time is timed apart with CUDA events. A CPU computes inside the call, so there the model is
built at a width of 64 with its own layer count (the same parameters by name, a few thousand elements each):
what is left is the host's work alone. The Trainer's step used to wait for the loss before calling the
optimizer, so on a GPU this host time was time the device sat idle (fivefold.train.trainer: it now queues the
update first and reads once).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import base_info, write_results

from fivefold.config import ConfigError, TrainConfig
from fivefold.memory.formulas import is_no_decay
from fivefold.model.init import build_model
from fivefold.presets import get_preset
from fivefold.train.optim import MasterWeightAdamW

NARROW = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 128,
          "vocab_size": 256}


def time_steps(model: torch.nn.Module, impl: str, device: str, steps: int) -> dict:
    """Ours (MasterWeightAdamW.step: clip, then chunk by chunk) and, step for step in turn, the reference:
    torch.optim.AdamW.step once over fp32 copies of all the parameters in the same two groups, as a plain
    training loop calls it (no chunks, no clipping, no bf16 copies to write back)."""
    cfg = TrainConfig(precision="bf16-mixed", optimizer_impl=impl)
    ours = MasterWeightAdamW(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    groups = [{"params": [m for n, m in zip(ours.names, masters) if not is_no_decay(n)], "weight_decay": 0.1},
              {"params": [m for n, m in zip(ours.names, masters) if is_no_decay(n)], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=1e-4, **({"foreach": True} if impl == "foreach" else {"fused": True}))

    def ours_step():
        for p in params:
            p.grad = torch.ones_like(p)
        return lambda: ours.step(1e-4, 1.0)

    def reference_step():
        for m in masters:
            m.grad = torch.ones_like(m)
        return reference.step

    times = {"ours": ([], []), "reference": ([], [])}
    for i in range(steps + 2):  # two warm-up steps each: state allocation, first launches
        for name, prepare in (("ours", ours_step), ("reference", reference_step)):
            call = prepare()
            if device == "cuda":
                torch.cuda.synchronize()
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
            start = time.perf_counter()
            call()
            returned = time.perf_counter() - start
            if device == "cuda":
                end_event.record()
                torch.cuda.synchronize()
            if i >= 2:
                times[name][0].append(returned)
                if device == "cuda":
                    times[name][1].append(start_event.elapsed_time(end_event) / 1e3)
    out = {"impl": impl}
    for name, (host, device_s) in times.items():
        out[name] = {"host_s_median": statistics.median(host), "host_s_min": min(host)}
        if device_s:
            out[name]["device_s_median"] = statistics.median(device_s)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--full", action="store_true", help="on a CPU, the preset's own width (default: width 64)")
    p.add_argument("--impl", default="fused,foreach,compiled", help="train.optimizer_impl values, comma-separated")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    try:
        model_cfg = get_preset(args.preset)
    except ConfigError as e:
        p.error(f"--preset: {e}")
    impls = args.impl.split(",")
    if not impls or any(i not in ("fused", "foreach", "compiled") for i in impls):
        p.error(f"--impl {args.impl!r}: give fused, foreach and/or compiled, comma-separated")
    narrow = args.device == "cpu" and not args.full
    if narrow:
        for key, value in NARROW.items():
            setattr(model_cfg, key, value)
    model = build_model(model_cfg, args.device).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{args.preset}: {len(params)} parameters, {sum(p.numel() for p in params) / 1e6:.2f}M elements"
          f"{' (width 64: the host work alone)' if narrow else ''}, on {args.device}")
    rows = [time_steps(model, impl, args.device, args.steps) for impl in impls]
    for r in rows:
        for name in ("ours", "reference"):
            t = r[name]
            line = (f"  {r['impl']:<8} {name:<10} host {1e3 * t['host_s_median']:.2f} ms a step "
                    f"(best {1e3 * t['host_s_min']:.2f})")
            if "device_s_median" in t:
                line += f", device {1e3 * t['device_s_median']:.2f} ms"
            print(line)
        print(f"  {r['impl']:<8} ours / reference host time: {r['ours']['host_s_median'] / r['reference']['host_s_median']:.2f}x")
    out = {"machine": base_info(args.device), "preset": args.preset, "device": args.device, "parameters": len(params),
           "elements": sum(p.numel() for p in params), "width": "narrow" if narrow else "full", "rows": rows}
    by_impl = {r["impl"]: r for r in rows}
    if "fused" in by_impl and "compiled" in by_impl:
        key = "device_s_median" if args.device == "cuda" else "host_s_median"
        ratio = by_impl["compiled"]["ours"][key] / by_impl["fused"]["ours"][key]
        out["compiled_over_fused"] = ratio
        print(f"  compiled / fused, ours, {key.split('_')[0]} time: {ratio:.2f}x")
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
