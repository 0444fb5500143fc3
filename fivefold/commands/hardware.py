"""`fivefold calibrate` (measure this machine into a hardware profile) and `fivefold hardware` (list or
show profiles)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from fivefold.commands.args import positive_int
from fivefold.config import Config
from fivefold.parallel.launch import launch_workers
from fivefold.parallel.mesh import local_device, resolve_device
from fivefold.planner.calibrate import calibrate
from fivefold.planner.hardware import load_profile, shipped_profiles
from fivefold.serve.step_cost import measure_serving


def register(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine (matmul peak per dtype, memory bandwidth, "
                                           "collectives) and write a hardware profile")
    cal.add_argument("--out", default="calibrated.toml", help="profile file to write (default calibrated.toml)")
    cal.add_argument("--name", help="the profile's name (default: the file's stem)")
    cal.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                     help="measure all-reduce / all-to-all between N processes on this machine (torchrun)")
    cal.add_argument("--device", default="auto", help="auto, cpu, cuda")
    cal.add_argument("--serve", action="store_true",
                     help="also measure the serving engine's step costs (the profile's [serving] table, read by "
                          "`fivefold plan --serve --cluster FILE --workload ...`)")
    cal.set_defaults(func=run_calibrate)
    hw = sub.add_parser("hardware", help="list the shipped hardware profiles, or show one (name or file)")
    hw.add_argument("profile", nargs="?", help="a profile name (e.g. h100-sxm) or a TOML file")
    hw.set_defaults(func=run_hardware)


def run_calibrate(args) -> int:
    import torch.distributed as dist

    device = resolve_device(args.device, "--device")
    out = Path(args.out)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return launch_workers(Config(), args.nproc, sys.argv[1:], "calibrate")
    if "LOCAL_RANK" in os.environ and not dist.is_initialized():
        device = local_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    profile, raw = calibrate(device, args.name or out.stem)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if args.serve:
        profile = dataclasses.replace(profile, serving=measure_serving(device, profile,
                                                                       "bf16" if device.type == "cuda" else "fp32"))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(profile.to_toml(), encoding="utf-8")
    os.replace(tmp, out)
    print(_summary(profile))
    if raw.get("all_to_all_bus_bandwidth"):
        print(f"all-to-all: {raw['all_to_all_latency_s'] * 1e6:.0f} us, {raw['all_to_all_bus_bandwidth'] / 1e9:.2f} "
              f"GB/s bus bandwidth (not a profile field: the planner uses the link figures)")
    print(f"wrote {out}")
    return 0


def run_hardware(args) -> int:
    if args.profile:
        print(_summary(load_profile(args.profile)))
        return 0
    for name in shipped_profiles():
        p = load_profile(name)
        print(f"{name:12s} {p.description}")
    return 0


def _summary(p) -> str:
    flops = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in p.flops.items() if v)
    link = (f"intra-node {p.intra_node_bandwidth / 1e9:.3g} GB/s, {p.intra_node_latency * 1e6:.3g} us; inter-node "
            f"{p.inter_node_bandwidth / 1e9:.3g} GB/s, {p.inter_node_latency * 1e6:.3g} us"
            if p.intra_node_bandwidth else "links not measured")
    kernels = "; ".join(
        f"{label}knee {k.matmul_knee:.3g}, efficiency {k.matmul_efficiency:.3g}, attention {k.attention_efficiency:.3g}"
        + (f" at head size 128 (knee {k.attention_knee:.3g})" if k.attention_knee else "")
        for label, k in [("", p)] + [(f"{dtype}: ", p.for_dtype(dtype)) for dtype in p.kernels])
    host = (f"\n  host: {p.host_step_s * 1e3:.3g} ms a step, {p.host_launch_s * 1e6:.3g} us a kernel, "
            f"{p.host_param_s * 1e6:.3g} us a parameter tensor" if p.host_launch_s or p.host_step_s else "")
    return (f"{p.name}: {p.description}\n  matmul: {flops}\n  kernels: {kernels}{host}\n  memory: "
            f"{p.memory_bytes / 1e9:.3g} GB at {p.memory_bandwidth / 1e9:.3g} GB/s\n  {p.gpus_per_node} per node; "
            f"{link}\n  source: {p.source}")
