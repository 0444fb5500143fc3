"""The host's part of one optimizer step: how long `MasterWeightAdamW.step` takes to return, over a model's own
parameter list, for the fused and the foreach AdamW.

    python bench/optimizer_host.py [--preset smollm2-135m] [--device cpu|cuda] [--json FILE]

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

from fivefold.config import TrainConfig
from fivefold.model.init import build_model
from fivefold.presets import get_preset
from fivefold.train.optim import MasterWeightAdamW

NARROW = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 128,
          "vocab_size": 256}


def time_step(model: torch.nn.Module, impl: str, device: str, steps: int) -> dict:
    cfg = TrainConfig(precision="bf16-mixed", optimizer_impl=impl)
    optimizer = MasterWeightAdamW(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    host, device_s = [], []
    for i in range(steps + 2):  # two warm-up steps: state allocation, first launches
        for p in params:
            p.grad = torch.ones_like(p)
        if device == "cuda":
            torch.cuda.synchronize()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        optimizer.step(1e-4, 1.0)
        returned = time.perf_counter() - start
        if device == "cuda":
            end_event.record()
            torch.cuda.synchronize()
        if i >= 2:
            host.append(returned)
            if device == "cuda":
                device_s.append(start_event.elapsed_time(end_event) / 1e3)
    out = {"impl": impl, "host_s_median": statistics.median(host), "host_s_min": min(host)}
    if device_s:
        out["device_s_median"] = statistics.median(device_s)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    model_cfg = get_preset(args.preset)
    if args.device == "cpu":
        for key, value in NARROW.items():
            setattr(model_cfg, key, value)
    model = build_model(model_cfg, args.device).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{args.preset}: {len(params)} parameters, {sum(p.numel() for p in params) / 1e6:.2f}M elements"
          f"{' (width 64: the host work alone)' if args.device == 'cpu' else ''}, on {args.device}")
    rows = [time_step(model, impl, args.device, args.steps) for impl in ("fused", "foreach")]
    for r in rows:
        line = f"  {r['impl']:<8} host {1e3 * r['host_s_median']:.2f} ms a step (best {1e3 * r['host_s_min']:.2f})"
        if "device_s_median" in r:
            line += f", device {1e3 * r['device_s_median']:.2f} ms"
        print(line)
    out = {"machine": base_info(), "preset": args.preset, "device": args.device, "parameters": len(params),
           "rows": rows}
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
