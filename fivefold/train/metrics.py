"""Step metrics: model FLOPs utilisation (against the datasheet peak of a known GPU, beside the measured
achievable peak; against the measured peak on a CPU), a JSONL log, TensorBoard, a progress bar."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.data.corpus import cache_dir
from fivefold.memory import host
from fivefold.parallel.mesh import synchronize
from fivefold.planner.hardware import load_profile, profile_for_device_name


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, reps: int = 8) -> float:
    """Achievable dense-matmul FLOP/s of this device and dtype, measured (not a datasheet number), so MFU
    is relative to what this machine's kernels really do with the threads it has. The fastest of several
    repetitions is kept: other load on the machine can only make a repetition slower."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):  # warm up: thread pools, kernel selection, AMX tiles
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def probed_peak_flops(device: torch.device, dtype: torch.dtype, budget_s: float = 5.0) -> float:
    """measure_peak_flops at full size, unless a small probe says that would take longer than `budget_s`:
    a dtype the device only emulates (bf16 on a CPU without AVX512-BF16 or AMX runs two orders of
    magnitude below fp32, minutes for the full measurement) keeps the probe's figure."""
    probe = measure_peak_flops(device, dtype, size=512, reps=3)
    full = 10 * 2 * 2048 ** 3 / probe  # the full measurement's matmuls (warm-up included) at the probe's rate
    return measure_peak_flops(device, dtype) if full <= budget_s else probe


# Square matmul size of the CUDA measurement: 8192^3 16-bit products fill every SM with large tiles for many
# waves, where 2048^3 reads ~55% of an H200's rate (432 of ~790 TFLOP/s). fp32 (no tensor cores, ~1/15 the
# rate) saturates sooner, and 4096^3 keeps its run under a second and its operands at 200 MB.
CUDA_PEAK_SIZE = {torch.float32: 4096}


def measure_cuda_peak_flops(device: torch.device, dtype: torch.dtype, reps: int = 10, rounds: int = 3) -> float:
    """Achievable dense-matmul FLOP/s of a GPU: `reps` back-to-back products timed by CUDA events (GPU
    time, no host launch gap or sync in it), the best of `rounds` such runs after a warm-up that settles
    clocks and cuBLAS's kernel choice. Random operands: constant ones let the GPU keep boost clocks that
    real data does not (the profiles' matmul_efficiency comment)."""
    size = CUDA_PEAK_SIZE.get(dtype, 8192)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = cuda_matmul_seconds(a, b, reps, rounds)
    del a, b
    torch.cuda.empty_cache()  # give the ~0.4 GB of operands back before training allocates
    return 2 * size ** 3 / best


def cuda_matmul_seconds(a: torch.Tensor, b: torch.Tensor, reps: int = 10, rounds: int = 3) -> float:
    """GPU seconds of one a @ b: `reps` back-to-back products timed by CUDA events, the best of `rounds` such
    runs after a warm-up (bench/matmul_shapes.py times each product of a step with it)."""
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)  # reused: no allocator traffic
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = float("inf")
    with torch.cuda.device(a.device):  # events record on the current device's stream: make it this one
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / reps)  # elapsed_time is in milliseconds
    return best


@functools.lru_cache(maxsize=None)
def peak_flops(device: torch.device, dtype: torch.dtype, threads: int) -> float:
    """Measured achievable matmul peak (CUDA: measure_cuda_peak_flops; CPU: probed_peak_flops), remembered
    across runs as the best ever seen for this device, dtype and thread count: a measurement taken while
    the machine is busy reads low and would inflate MFU."""
    if device.type == "cuda":  # the method is in the key: figures of the old 2048^3 host-timed one read low
        key = f"{torch.cuda.get_device_name(device)}|{dtype}|cuda-events-{CUDA_PEAK_SIZE.get(dtype, 8192)}"
    else:
        key = f"cpu|{dtype}|{threads}"
    key += f"|{torch.__version__}"
    path = cache_dir() / "peak_flops.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    measured = measure_cuda_peak_flops(device, dtype) if device.type == "cuda" else probed_peak_flops(device, dtype)
    peak = max(measured, known.get(key, 0.0))
    if peak != known.get(key):
        known[key] = peak
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return peak


PROFILE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def datasheet_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense FLOP/s of `dtype`, profile name) from the shipped hardware profile of this GPU
    (fivefold.planner.hardware.profile_for_device_name), or None: a CPU, or a GPU no profile describes."""
    if device.type != "cuda":
        return None
    name = profile_for_device_name(torch.cuda.get_device_name(device))
    if name is None:
        return None
    return load_profile(name).peak_flops(PROFILE_DTYPES[dtype]), name


@dataclass(frozen=True)
class MfuPeaks:
    """The FLOP/s per device MFU is computed against. `peak` is the denominator of `mfu`; `achievable`,
    when set, the measured peak beside a datasheet one (the `mfu_achievable` metric). `source` says where
    `peak` comes from, for the start-up line."""
    peak: float
    source: str
    achievable: float | None = None

    def describe(self) -> str:
        text = f"peak {_rate(self.peak)} ({self.source})"
        if self.achievable is not None:
            text += f", measured achievable {_rate(self.achievable)}"
        return text


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def mfu_peaks(device: torch.device, dtype: torch.dtype, override: float, threads: int) -> MfuPeaks:
    """Which peak MFU divides by. `override` (train.peak_flops, 0 = unset) wins and nothing is measured. On
    a GPU a hardware profile describes: its dense datasheet figure for `dtype`, the one every published MFU
    uses, with the measured achievable peak beside it. Otherwise the measured peak: on a CPU (there is no
    datasheet) and on a GPU no profile describes (the start-up line says so). A datasheet peak is above any
    rate the kernels reach, and the measured one is the best large matmul, which a training step's smaller
    and mixed work does not exceed: so neither MFU should read above 100%. (Not against fp32's datasheet
    figure with TF32 switched on, which the profiles do not hold; nor fp8, whose MFU is against bf16.)"""
    if override:
        return MfuPeaks(override, "train.peak_flops")
    datasheet = datasheet_peak_flops(device, dtype)
    measured = peak_flops(device, dtype, threads)
    if datasheet is not None:
        flops, profile = datasheet
        return MfuPeaks(flops, f"{PROFILE_DTYPES[dtype]} datasheet, hardware profile {profile}", measured)
    if device.type == "cuda":
        return MfuPeaks(measured, f"measured: no hardware profile matches {torch.cuda.get_device_name(device)!r}, "
                                  f"so MFU is against the measured achievable peak")
    return MfuPeaks(measured, "measured")


def memory_bytes(device: torch.device) -> int:
    """Memory in use now: the CUDA caching allocator's allocated bytes, or this process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return host.resident()


class MetricsLog:
    """Writes one JSON object per logged step to metrics.jsonl, and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard: bool, append: bool):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.file = open(self.path, "a" if append else "w", encoding="utf-8")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                self.writer = None

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not enabled or not sys.stderr.isatty())
