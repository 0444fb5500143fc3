"""`fivefold calibrate`: measure this machine and write a hardware profile.

Measured, each as the best of several repetitions (outside load only slows a repetition down):
- matmul peak per dtype: fp32 and bf16 (fp16 too on CUDA), square matmuls (train.metrics.measure_peak_flops);
- memory bandwidth: a sum over a large fp32 tensor (reads only);
- memory size: the device's (CUDA) or the host's RAM (CPU);
- the step-time model's kernel figures (fivefold/planner/hardware.py): the matmul knee, fitted to square
  matmuls of 256 and 2048 (the model reproduces [flops], measured at 2048, there); fused attention's fraction of
  the matmul peak (SDPA forward + backward, causal); elementwise bandwidth (a copy) against the read
  bandwidth; seconds per small autograd op (host overhead); overlap 0 on a CPU host, whose gloo threads
  share the cores with compute, 1 on CUDA. The matmul and attention figures are measured in fp32 and in bf16:
  the dtype training computes in on the device (bf16 on CUDA, fp32 on a CPU) gives the top-level fields, the
  other its [kernels.<dtype>] table. On a CPU with native bf16 its kernels sit much further below its peak
  (a planner priced with fp32's figures was 47% optimistic on a bf16-mixed run there);
- with `--nproc N` (N >= 2 processes under torchrun, gloo on CPU, NCCL on CUDA): all-reduce and all-to-all
  latency (an 8-byte message, median) and bus bandwidth at 64 MiB (NCCL-tests' convention: all-reduce
  moves 2(n-1)/n of the buffer per rank, all-to-all (n-1)/n). One machine has no inter-node link: those
  fields repeat the intra-node figures and the profile's source says so.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist

from fivefold.memory import host
from fivefold.parallel.mesh import synchronize
from fivefold.planner.hardware import HardwareProfile
from fivefold.train.metrics import measure_peak_flops, probed_peak_flops

LATENCY_REPS = 30
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BANDWIDTH_BYTES = 64 * 2**20


def measure_bandwidth(gb: float = 1.0, reps: int = 5, device: torch.device | str = "cpu") -> dict:
    """Memory bandwidth as this process sees it, best of `reps`: a sum over a `gb` GB fp32 tensor (reads
    only, like a decode step's weights and cache) and a copy of it (counted as read + write)."""
    device = torch.device(device)
    x = torch.ones(int(gb * 1e9) // 4, device=device)
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)
    best = {"sum": float("inf"), "copy": float("inf")}
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        best["sum"] = min(best["sum"], time.perf_counter() - start)
        start = time.perf_counter()
        y.copy_(x)
        synchronize(device)
        best["copy"] = min(best["copy"], time.perf_counter() - start)
    nbytes = x.numel() * 4
    return {"read_gb_per_s": nbytes / best["sum"] / 1e9, "copy_gb_per_s": 2 * nbytes / best["copy"] / 1e9,
            "tensor_gb": nbytes / 1e9}


def measure_flops(device: torch.device) -> dict[str, float]:
    # A CPU without native bf16 emulates it two orders of magnitude slower: the probe keeps that short.
    flops = {"fp32": probed_peak_flops(device, torch.float32), "bf16": probed_peak_flops(device, torch.bfloat16)}
    if device.type == "cuda":
        flops["fp16"] = probed_peak_flops(device, torch.float16)
    return flops


def measure_kernels(device: torch.device, dtype: torch.dtype, peak: float) -> dict[str, float]:
    """matmul_knee, matmul_efficiency and attention_efficiency in `dtype` (see the module docstring)."""
    small = measure_peak_flops(device, dtype, size=256, reps=20)
    ratio = min(small / peak, 0.999)
    # (256 / (256 + k) / (2048 / (2048 + k)))^3 = ratio: bisect for k
    low, high = 0.0, 1e5
    for _ in range(60):
        k = (low + high) / 2
        if ((256 / (256 + k)) / (2048 / (2048 + k))) ** 3 > ratio:
            low = k
        else:
            high = k
    knee = (low + high) / 2
    # [flops] is the 2048^3 rate, which the knee already discounts: the asymptote sits above it.
    out = {"matmul_knee": knee, "matmul_efficiency": 1 / (2048 / (2048 + knee)) ** 3}
    b, heads, s, hd = 4, 8, 512, 64
    q, k_, v = (torch.randn(b, heads, s, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    best = float("inf")
    for rep in range(4):
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True).sum().backward()
        synchronize(device)
        if rep:  # the first is warm-up
            best = min(best, time.perf_counter() - start)
    out["attention_efficiency"] = min(1.0, 3.5 * 2 * b * heads * s * s * hd / best / peak)  # causal: half of 4bhs^2d
    return out


def measure_op_overhead(device: torch.device) -> float:
    """Seconds of host time per small autograd op: the same for every dtype."""
    x = torch.ones(8, device=device, requires_grad=True)
    ops, best = 20, float("inf")
    for rep in range(30):
        start = time.perf_counter()
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
        synchronize(device)
        if rep:
            best = min(best, time.perf_counter() - start)
    return best / (2 * ops + 2)  # forward and backward kernels


def memory_size(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host.total()


def measure_collectives(device: torch.device) -> dict[str, float]:
    """Latency (s) and bus bandwidth (bytes/s) of all-reduce and all-to-all over the default group."""
    n = dist.get_world_size()
    small = torch.zeros(2, device=device)
    big = torch.zeros(BANDWIDTH_BYTES // 4, device=device)
    out_small, out_big = torch.empty_like(small), torch.empty_like(big)
    ops = {"all_reduce": (lambda x, _: dist.all_reduce(x), 2 * (n - 1) / n),
           "all_to_all": (lambda x, out: dist.all_to_all_single(out, x), (n - 1) / n)}
    result = {}
    for name, (op, factor) in ops.items():
        for _ in range(3):
            op(small, out_small)
            op(big, out_big)
        latencies = [_timed_collective(op, small, out_small, device) for _ in range(LATENCY_REPS)]
        best = min(_timed_collective(op, big, out_big, device) for _ in range(5))
        result[f"{name}_latency_s"] = statistics.median(latencies)
        result[f"{name}_bus_bandwidth"] = factor * BANDWIDTH_BYTES / best
    return result


def _timed_collective(op, x, out, device) -> float:
    dist.barrier()
    start = time.perf_counter()
    op(x, out)
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
    return float(elapsed)


def calibrate(device: torch.device, name: str) -> tuple[HardwareProfile, dict]:
    """Measure this machine (collectives too when a process group is running) -> (profile, raw figures)."""
    raw: dict[str, float] = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        raw.update(measure_collectives(device))
    flops = measure_flops(device)
    memory = measure_bandwidth(1.0, device=device)
    bandwidth = memory["read_gb_per_s"] * 1e9
    dtype = "bf16" if device.type == "cuda" else "fp32"  # what training computes in on this device
    kernels = measure_kernels(device, TORCH_DTYPES[dtype], flops[dtype])
    kernels["op_overhead"] = measure_op_overhead(device)
    other = "fp32" if dtype == "bf16" else "bf16"  # the other training dtype, for its own [kernels.<dtype>]
    per_dtype = {other: measure_kernels(device, TORCH_DTYPES[other], flops[other])}
    raw.update({f"{other}_{k}": v for k, v in per_dtype[other].items()})
    kernels["memory_efficiency"] = min(1.0, memory["copy_gb_per_s"] / memory["read_gb_per_s"])
    kernels["overlap"] = 1.0 if device.type == "cuda" else 0.0
    raw.update(kernels)
    raw.update({f"flops_{k}": v for k, v in flops.items()}, memory_bandwidth=bandwidth)
    link = raw.get("all_reduce_bus_bandwidth", 0.0)
    latency = raw.get("all_reduce_latency_s", 0.0)
    host = socket.gethostname()
    what = (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model())
    backend = "NCCL" if device.type == "cuda" else "gloo"
    links = (f"links: {backend} all-reduce over {world} processes; one machine, so the inter-node figures "
             f"repeat the intra-node ones" if world > 1 else "links: not measured (one process)")
    profile = HardwareProfile(
        name=name, description=f"{what}, {_threads()}" if device.type == "cpu" else what,
        device=device.type, memory_bytes=float(memory_size(device)), memory_bandwidth=bandwidth,
        gpus_per_node=world, intra_node_bandwidth=link, intra_node_latency=latency,
        inter_node_bandwidth=link, inter_node_latency=latency, flops=flops, **kernels, kernels=per_dtype,
        source=f"fivefold calibrate on {host}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}; {links}")
    return profile, raw


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n > 1 else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"
